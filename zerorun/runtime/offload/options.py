"""What offload was asked for, resolved once from ``RuntimeSettings`` into one frozen object.

The DeepSpeed keys (``zero_optimization.offload_optimizer`` / ``offload_param`` / ``sub_group_size``)
and zerorun's own (``zerorun.delayed_param_update``, ``delayed_param_update_warmup``,
``offload_cpu_threads``) are read here and nowhere else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from zerorun.errors import RuntimeConfigError

__all__ = ["OffloadOptions", "options_from_settings", "cores_per_rank", "PIPELINE_TILE"]

# Elements per tile of the CPU pipeline (D2H of gradients | CPU step | H2D of parameters): small
# enough that the first copy and the last one are short next to the step (16M fp32 = 64 MB),
# large enough that per-tile overhead (a few kernel calls, one event) is negligible.
PIPELINE_TILE = 1 << 24


def _get(obj: Any, dotted: str, default: Any = None) -> Any:
    for part in dotted.split("."):
        if obj is None:
            return default
        obj = obj.get(part, None) if isinstance(obj, dict) else getattr(obj, part, None)
    return default if obj is None else obj


@dataclass(frozen=True)
class OffloadOptions:
    optimizer_device: str = "none"  # none | cpu | nvme
    param_device: str = "none"  # none | cpu | nvme (stage 3)
    pin_memory: bool = False  # offload_optimizer.pin_memory
    param_pin_memory: bool = False  # offload_param.pin_memory
    nvme_path: str | None = None  # offload_optimizer.nvme_path
    param_nvme_path: str | None = None
    buffer_count: int = 4  # offload_optimizer.buffer_count: NVMe tile buffers (read-ahead depth + 1)
    param_buffer_count: int = 5
    sub_group_size: int = 1_000_000_000  # NVMe tile (elements); the CPU pipeline uses min(this, PIPELINE_TILE)
    delayed_update: bool = False
    delayed_warmup: int = 0
    cpu_threads: int = 0  # 0: automatic (cores_per_rank)
    stage: int = 0
    # The step needs no global norm (no clipping, no fp16 overflow check): a flat buffer's CPU
    # step may start during backward, as soon as its reduced gradient is final.
    early_start: bool = False

    @property
    def cpu_tile(self) -> int:
        return max(1, min(self.sub_group_size, PIPELINE_TILE))

    def step_threads(self) -> int:
        """Threads of the CPU optimizer step. Automatic: this rank's share of the cores it may
        use; one fewer when the step overlaps the training loop (delayed update, or a step
        started during backward), since a starved Python thread starves the GPU of launches."""
        if self.cpu_threads > 0:
            return self.cpu_threads
        n = cores_per_rank()
        overlaps = self.delayed_update or (self.early_start and self.stage >= 1)
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


def options_from_settings(settings: Any) -> OffloadOptions:
    zero = settings.zero
    extra = getattr(settings, "zerorun", None)
    opt_dev = str(_get(zero, "offload_optimizer.device", "none") or "none")
    param_dev = str(_get(zero, "offload_param.device", "none") or "none")
    stage = int(settings.stage)
    if stage == 0 and opt_dev != "none":
        opt_dev = "none"  # the config loader already warned: no effect at stage 0
    if stage < 3 and param_dev != "none":
        param_dev = "none"  # ditto: parameter offload is a stage-3 feature
    for key, dev in (("offload_optimizer", opt_dev), ("offload_param", param_dev)):
        if dev not in ("none", "cpu", "nvme"):
            raise RuntimeConfigError(f"zero_optimization.{key}.device {dev!r}: use none, cpu or nvme")
        if dev == "nvme" and not _get(zero, f"{key}.nvme_path"):
            raise RuntimeConfigError(
                f"zero_optimization.{key}.device is nvme but {key}.nvme_path is not set: "
                "give a directory on a fast local disk of every node"
            )
    # Without optimizer offload there is no CPU step to delay (the config loader warned).
    delayed = bool(_get(extra, "delayed_param_update", False)) and opt_dev != "none"
    sub_group = int(_get(zero, "sub_group_size", 1_000_000_000))
    if sub_group < 1:
        raise RuntimeConfigError("zero_optimization.sub_group_size must be at least 1 element")
    return OffloadOptions(
        optimizer_device=opt_dev,
        param_device=param_dev,
        pin_memory=bool(_get(zero, "offload_optimizer.pin_memory", False)),
        param_pin_memory=bool(_get(zero, "offload_param.pin_memory", False)),
        nvme_path=_get(zero, "offload_optimizer.nvme_path"),
        param_nvme_path=_get(zero, "offload_param.nvme_path"),
        buffer_count=int(_get(zero, "offload_optimizer.buffer_count", 4)),
        param_buffer_count=int(_get(zero, "offload_param.buffer_count", 5)),
        sub_group_size=sub_group,
        delayed_update=delayed,
        delayed_warmup=int(_get(extra, "delayed_param_update_warmup", 0)),
        cpu_threads=int(_get(extra, "offload_cpu_threads", 0)),
        stage=stage,
        early_start=not float(getattr(settings, "gradient_clipping", 0.0) or 0.0) > 0
        and not bool(getattr(settings, "fp16", False)),
    )
