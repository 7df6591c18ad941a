"""The model's trainable parameters as views into flat buffers (stages 0-2).

Every trainable parameter's ``.data`` becomes a view into one flat buffer of the compute dtype
(partition.py defines the words), so the whole model can be written back after a step with one
copy or one all-gather per flat buffer instead of one per parameter. The ``nn.Parameter`` objects
stay the same objects: module code, hooks and user references keep working.

Stage 3 keeps only shards at rest and builds its own store; it reuses ``collect_trainable`` and
the layouts from partition.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerorun.runtime.partition import SLOT_ALIGN_BYTES, FlatLayout, ParamSpec, plan_flat_buffers
from zerorun.runtime.precision import dtype_name

__all__ = ["TrainableParam", "collect_trainable", "FlatParamBuffers"]


@dataclass
class TrainableParam:
    name: str
    param: nn.Parameter
    group: int
    aliases: tuple[str, ...]


def collect_trainable(
    module: nn.Module, group_of: dict[int, int] | None
) -> tuple[list[TrainableParam], list[str]]:
    """Trainable parameters, each once (tied weights: first name, others as aliases), in the
    order gradients are expected (reverse registration). ``group_of`` maps id(param) to an
    optimizer param-group index; parameters it does not list are left alone (returned as
    ``skipped`` names), as plain PyTorch would leave a parameter its optimizer does not hold."""
    names: dict[int, list[str]] = {}
    order: list[nn.Parameter] = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in names:
            names[id(p)] = []
            order.append(p)
        names[id(p)].append(name)
    out: list[TrainableParam] = []
    skipped: list[str] = []
    for p in reversed(order):
        if not p.requires_grad:
            continue
        all_names = names[id(p)]
        if group_of is not None and id(p) not in group_of:
            skipped.append(all_names[0])
            continue
        group = 0 if group_of is None else group_of[id(p)]
        out.append(TrainableParam(all_names[0], p, group, tuple(all_names[1:])))
    return out, skipped


class FlatParamBuffers:
    """Flat buffers of the compute dtype whose slices are the model's trainable parameters."""

    def __init__(
        self,
        trainable: list[TrainableParam],
        *,
        param_dtype: torch.dtype,
        device: torch.device,
        num_shards: int,
        bucket_numel: int,
    ) -> None:
        specs = [
            ParamSpec(t.name, tuple(t.param.shape), dtype_name(param_dtype), t.group, t.aliases)
            for t in trainable
        ]
        self.layouts: list[FlatLayout] = plan_flat_buffers(
            specs, num_shards=num_shards, bucket_numel=bucket_numel, slot_align_bytes=SLOT_ALIGN_BYTES
        )
        self.params: list[list[nn.Parameter]] = []
        self.buffers: list[torch.Tensor] = []
        self.device = device
        self.dtype = param_dtype
        by_name = {t.name: t.param for t in trainable}
        for layout in self.layouts:
            flat = torch.zeros(layout.padded_numel, dtype=param_dtype, device=device)  # gaps + tail stay 0
            params = []
            for slot in layout.slots:
                p = by_name[slot.name]
                view = flat[slot.offset : slot.offset + slot.numel]
                with torch.no_grad():
                    view.copy_(p.detach().reshape(-1))
                params.append(p)
            self.buffers.append(flat)
            self.params.append(params)

    def bind(self) -> None:
        """Make each parameter's storage its slice of the flat buffer (frees the old storage)."""
        for layout, flat, params in zip(self.layouts, self.buffers, self.params, strict=True):
            for slot, p in zip(layout.slots, params, strict=True):
                p.data = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def shard(self, index: int, shard: int) -> torch.Tensor:
        start, end = self.layouts[index].shard_range(shard)
        return self.buffers[index][start:end]

    def fp32_shard_from(self, index: int, shard: int, originals: dict[str, torch.Tensor]) -> torch.Tensor:
        """This shard's values in fp32 taken from the original (pre-cast) parameters, so master
        weights start exactly at the user's initialization rather than at its bf16 rounding."""
        layout = self.layouts[index]
        start, end = layout.shard_range(shard)
        out = torch.zeros(end - start, dtype=torch.float32, device=self.device)
        for slot, lo, hi in layout.pieces_in_range(start, end):
            src = originals[slot.name].reshape(-1)[lo:hi]
            out[slot.offset + lo - start : slot.offset + hi - start].copy_(src)
        return out

    @property
    def numel(self) -> int:
        return sum(layout.numel for layout in self.layouts)
