"""The partial optimizer offload (Twin-Flow, offload_optimizer.ratio): how much of master +
optimizer states stays on the GPU, and the GPU budget's element count for ratio "auto"."""

from __future__ import annotations

from typing import Any

from zerorun.estimate.inputs import GB, _as_config
from zerorun.estimate.per_element import BytesPerElement


def twin_flow_device_bytes(bpe: BytesPerElement) -> int:
    """GPU bytes per shard element of the part of the optimizer a partial offload keeps on the
    GPU: the fp32 master (none in fp32 training: the parameter shard is the master) + states."""
    return bpe.master + bpe.optimizer_states


def offload_budget_numel(config: Any) -> int:
    """Shard elements per rank whose master + optimizer states fit ``zerorun.offload_gpu_budget_gb``
    (``offload_optimizer.ratio: "auto"``); the runtime keeps that many on the GPU, the estimate too."""
    cfg = _as_config(config)
    budget = float(cfg.zerorun.offload_gpu_budget_gb) * GB
    width = twin_flow_device_bytes(BytesPerElement.from_config(cfg))
    return int(budget // width) if width else 2**62


def _host_share(cfg: Any, stage: int, num_params: int, n: int) -> float:
    """The host's share of master + optimizer states per rank (offload_optimizer.ratio)."""
    ratio = cfg.zero_optimization.offload_optimizer.ratio
    if ratio != "auto":
        return float(ratio)
    shard = num_params / n if stage >= 1 else float(num_params)
    if shard <= 0:
        return 1.0
    return max(0.0, 1.0 - min(shard, offload_budget_numel(cfg)) / shard)
