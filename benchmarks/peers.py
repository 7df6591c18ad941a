"""The peers zerorun is measured against: plain PyTorch, DDP, FSDP2 (optionally CPU offload).

Each is set up the way its documentation recommends, with the shared recipe (`workload.py`):
- plain: fp32 weights, bf16 autocast, fused AdamW — the baseline.
- DDP: the same inside DistributedDataParallel (gradients as bucket views, which saves a copy).
- FSDP2: `fully_shard` on every block and then on the root, MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32), fused AdamW over the sharded fp32 parameters; with `cpu_offload`, plus
  CPUOffloadPolicy (parameters, gradients and the optimizer step on the host).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from benchmarks.rankenv import RankContext
from benchmarks.workload import adamw

__all__ = ["PlainTrainer", "DDPTrainer", "FSDP2Trainer", "fsdp2_api"]


class PlainTrainer:
    """One process, fp32 weights, bf16 autocast, fused AdamW."""

    def __init__(self, model: nn.Module, ctx: RankContext) -> None:
        self.model = model
        self.device = ctx.device
        self.optimizer = adamw(model.parameters(), ctx.device)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            loss = self.model(x, y)
        loss.backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def memory_report(self) -> dict[str, Any] | None:
        return None


class DDPTrainer(PlainTrainer):
    def __init__(self, model: nn.Module, ctx: RankContext) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        wrapped = DDP(model, device_ids=ids, gradient_as_bucket_view=True)
        super().__init__(wrapped, ctx)


def fsdp2_api() -> tuple[Any, Any, Any]:
    """(fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy): public since torch 2.6, under
    `_composable` before."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            fully_shard,
        )
    return fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy


class FSDP2Trainer(PlainTrainer):
    """FSDP2 casts parameters to bf16 itself, so no autocast: the model computes in bf16 and
    its loss in fp32 (gpt_model's cross-entropy upcasts), like the autocast peers."""

    def __init__(self, model: nn.Module, ctx: RankContext, *, cpu_offload: bool) -> None:
        fully_shard, mp_cls, offload_cls = fsdp2_api()
        kw: dict[str, Any] = {"mp_policy": mp_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        if cpu_offload:
            kw["offload_policy"] = offload_cls()
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        super().__init__(model, ctx)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()
