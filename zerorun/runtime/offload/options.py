"""What offload was asked for: ``RuntimeSettings.offload`` (the config keys, read once in
``runtime/settings.py``) plus what offload derives from the rest of the settings, in one frozen
object, and the thread sizing of the CPU step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

from zerorun.runtime.settings import OffloadSettings, RuntimeSettings

__all__ = ["OffloadOptions", "options_from_settings", "grads_are_bf16", "cores_per_rank", "rank_cores", "PIPELINE_TILE"]

# Elements per tile of the CPU pipeline (D2H of gradients | CPU step | H2D of parameters): small
# enough that the first copy and the last one are short next to the step (16M fp32 = 64 MB),
# large enough that per-tile overhead (a few kernel calls, one event) is negligible.
PIPELINE_TILE = 1 << 24


@dataclass(frozen=True)
class OffloadOptions(OffloadSettings):
    """The offload settings plus what offload derives from the rest of the settings."""

    stage: int
    # The step needs no global norm (no clipping, no fp16 overflow check): a flat buffer's CPU
    # step may start during backward, as soon as its reduced gradient is final.
    early_start: bool
    # The reduced gradient shards hold bf16 values exactly (runtime/offload/cpu_kernel.py): the
    # host may take them as bf16 (2 bytes down instead of 4) and step them with the kernel that
    # widens in the same pass. True when the reduction itself is in bf16
    # (communication_data_type), or for bf16 training with fp32 reductions on one rank, one
    # micro-step per step and no clipping -- each element is then one bf16 gradient widened by
    # a copy (no sum, no scaling: grad_reduce.py and stage3/param_group.py at one rank).
    narrow_grads: bool = False

    @property
    def cpu_tile(self) -> int:
        return max(1, min(self.sub_group_size, PIPELINE_TILE))

    def step_threads(self) -> int:
        """Threads of the CPU optimizer step. Automatic: this rank's share of the cores it may
        use; one fewer when the step overlaps the training loop -- the delayed update (the next
        forward and backward), a step started in the backward (the backward's hooks and
        reductions run beside it; stage 3 parameter offload: also the next forward) -- since a
        starved Python thread starves the GPU of launches, and one preempted thread holds up
        the whole parallel region. Measured on one H200 host (16 cores): alone the step ran 8 %
        faster with 16 threads than with 15 (benchmarks/results/cpu_step_bandwidth_sweep_h200.json),
        but in the 1.3B exact offload rows with the backward beside it 16 threads made it 15-18 %
        slower (adam_s 0.374 s vs 0.317 s at stage 3: results 20261201T182912Z vs 20261201T175823Z,
        two commits that also differ in the worker's buffer order: not a clean comparison)."""
        if self.cpu_threads > 0:
            return self.cpu_threads
        n = cores_per_rank()
        overlaps = self.delayed_update or (self.early_start and self.stage >= 1)
        return max(1, n - 1) if overlaps and n > 2 else n


def rank_cores() -> list[int]:
    """The cores this rank's CPU work may use: its affinity when it has one of its own (a
    scheduler's CPU binding, taskset); when the ranks of a node all share the node's cores
    (LOCAL_WORLD_SIZE above 1 and an affinity of the whole machine: zerorun's launcher), its
    slice of them -- LOCAL_RANK's ``cores // ranks`` consecutive cores, at least one."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = list(range(os.cpu_count() or 1))
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    except ValueError:
        local, rank = 1, 0
    if local > 1 and len(allowed) >= (os.cpu_count() or 0):
        k = max(1, len(allowed) // local)
        rank = min(max(rank, 0), local - 1)
        return allowed[rank * k : (rank + 1) * k] or allowed[:1]
    return allowed


def cores_per_rank() -> int:
    return len(rank_cores())


def grads_are_bf16(settings: RuntimeSettings) -> bool:
    """Does every reduced gradient element hold a bf16 value exactly (``narrow_grads``)?"""
    policy, batch = settings.precision.policy, settings.batch
    if settings.precision.fp16:
        return False
    if policy.reduce_dtype == torch.bfloat16:
        return True
    world = batch.train_batch // max(1, batch.micro_batch * batch.grad_accum)
    return (
        policy.param_dtype == torch.bfloat16
        and policy.reduce_dtype == torch.float32
        and world == 1
        and batch.grad_accum == 1
        and not settings.optimizer.gradient_clipping > 0
    )


def options_from_settings(settings: RuntimeSettings) -> OffloadOptions:
    """The devices already read ``none`` where the stage ignores them, and ``nvme_path`` is set
    for an ``nvme`` device: ``config/rules.py`` decided both when the config was loaded."""
    return OffloadOptions(
        **{f.name: getattr(settings.offload, f.name) for f in fields(OffloadSettings)},
        stage=settings.stage,
        early_start=not settings.optimizer.gradient_clipping > 0 and not settings.precision.fp16,
        narrow_grads=grads_are_bf16(settings),
    )
