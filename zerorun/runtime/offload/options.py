"""What offload was asked for: ``RuntimeSettings.offload`` (the config keys, read once in
``runtime/settings.py``) plus what offload derives from the rest of the settings, in one frozen
object, and the thread sizing of the CPU step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from zerorun.runtime.settings import OffloadSettings, RuntimeSettings

__all__ = ["OffloadOptions", "options_from_settings", "cores_per_rank", "PIPELINE_TILE"]

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

    @property
    def cpu_tile(self) -> int:
        return max(1, min(self.sub_group_size, PIPELINE_TILE))

    def step_threads(self) -> int:
        """Threads of the CPU optimizer step. Automatic: this rank's share of the cores it may
        use; one fewer when the training loop runs beside the step -- the delayed update (the
        next forward and backward), and stage 3 parameter offload with the step started in the
        backward (the next forward starts while the CPU steps, HostPlacement.settle) -- since a
        starved Python thread starves the GPU of launches. A step started in the backward
        otherwise takes every core: the loop has queued the whole backward by the time the first
        gradients reach the host and then waits in step() (one H200 host, 16 cores, 128M
        elements: 16 threads 122.6 GB/s, 15 threads 112.9 GB/s, medians of
        benchmarks/results/cpu_step_bandwidth_sweep_h200.json)."""
        if self.cpu_threads > 0:
            return self.cpu_threads
        n = cores_per_rank()
        overlaps = self.delayed_update or (self.early_start and self.stage == 3 and self.param_device != "none")
        return max(1, n - 1) if overlaps and n > 2 else n


def cores_per_rank() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    except ValueError:
        local = 1
    return max(1, cores // max(local, 1))


def options_from_settings(settings: RuntimeSettings) -> OffloadOptions:
    """The devices already read ``none`` where the stage ignores them, and ``nvme_path`` is set
    for an ``nvme`` device: ``config/rules.py`` decided both when the config was loaded."""
    return OffloadOptions(
        **{f.name: getattr(settings.offload, f.name) for f in fields(OffloadSettings)},
        stage=settings.stage,
        early_start=not settings.optimizer.gradient_clipping > 0 and not settings.precision.fp16,
    )
