"""Pure partition math: which parameter lives where, and which slice each rank owns.

Vocabulary (used by every runtime module; defined here once):

* **flat buffer** -- one contiguous 1-D tensor holding several parameters back to back (in the
  order their gradients are expected: reverse registration order), followed by zero padding so
  that its length divides evenly into ``num_shards`` equal, aligned pieces. A flat buffer never
  mixes dtypes or optimizer param groups. It is also the unit of gradient communication: one
  reduce-scatter / all-reduce / all-gather per flat buffer, so its size is bounded by
  ``reduce_bucket_size`` (a parameter larger than that gets a flat buffer of its own).
* **bucket** -- a flat buffer seen as a unit of communication (same boundaries). The word is kept
  because DeepSpeed's config speaks of bucket sizes.
* **shard** -- rank ``r``'s contiguous piece ``[r * S, (r + 1) * S)`` of a flat buffer, where
  ``S = padded_numel / num_shards``. Stage 0 uses ``num_shards = 1`` (the shard is the whole
  buffer); stages 1-3 use ``num_shards = world_size``.
* **partition** -- the set of all shards one rank owns (one per flat buffer); it is what the fp32
  master weights, optimizer states and (stage 2+) reduced gradients cover on that rank.

Nothing here imports torch: dtypes are names (``"bfloat16"``), so the layout is serialisable as
plain JSON and checkpoint resharding (any world size -> any other) can be computed from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ParamSpec",
    "ParamSlot",
    "FlatLayout",
    "plan_flat_buffers",
    "round_up",
    "DEFAULT_ALIGN",
    "SLOT_ALIGN_BYTES",
]

# Shards start on multiples of this many elements: 64 elements is 128 bytes in bf16, the
# alignment NCCL and vectorised kernels like. The cost is < num_shards * 64 padding elements
# per flat buffer.
DEFAULT_ALIGN = 64
# The runtime also starts every parameter (slot) on a 16-byte boundary inside its flat buffer
# (zero gaps between slots). A parameter is a view of its flat buffer, and compiled kernels
# (inductor's Triton code) specialise on 16-byte aligned pointers: a compiled graph shared by
# several identical blocks read a misaligned view of another block ("CUDA error: misaligned
# address") when one odd-sized parameter (a bias of 1 element, a vocabulary of 50257) shifted
# everything after it. FSDP1 pads its flat parameters the same way. Costs < 16 bytes per
# parameter.
SLOT_ALIGN_BYTES = 16
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know about one trainable parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    group: int = 0  # index of the optimizer param group
    aliases: tuple[str, ...] = ()  # other names of the same tensor (tied weights)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in a flat buffer: elements ``[offset, offset + numel)``."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    numel: int
    aliases: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "offset": self.offset,
            "numel": self.numel,
            "aliases": list(self.aliases),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParamSlot:
        return cls(
            name=d["name"],
            shape=tuple(d["shape"]),
            dtype=d["dtype"],
            offset=int(d["offset"]),
            numel=int(d["numel"]),
            aliases=tuple(d.get("aliases", ())),
        )


@dataclass(frozen=True)
class FlatLayout:
    """The layout of one flat buffer and how it is cut into shards."""

    index: int
    group: int
    dtype: str
    slots: tuple[ParamSlot, ...]
    numel: int  # elements up to the end of the last parameter (slot gaps included)
    padded_numel: int  # numel rounded up so that every shard has the same aligned size
    num_shards: int
    _by_name: dict[str, ParamSlot] = field(default_factory=dict, repr=False, compare=False)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.num_shards

    def shard_range(self, shard: int) -> tuple[int, int]:
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard {shard} out of range for {self.num_shards} shards")
        s = self.shard_numel
        return shard * s, (shard + 1) * s

    def pieces_in_range(self, start: int, end: int) -> list[tuple[ParamSlot, int, int]]:
        """Parameters overlapping ``[start, end)``, each as ``(slot, lo, hi)`` with ``lo, hi``
        offsets *inside the parameter's flattened values*. A shard boundary may cut a parameter
        in two; checkpoint resharding and per-parameter views of a shard use this."""
        out: list[tuple[ParamSlot, int, int]] = []
        for slot in self.slots:
            lo = max(start, slot.offset)
            hi = min(end, slot.offset + slot.numel)
            if lo < hi:
                out.append((slot, lo - slot.offset, hi - slot.offset))
        return out

    def gaps(self) -> list[tuple[int, int]]:
        """``[start, end)`` ranges between parameters (slot alignment), zero in every buffer."""
        out, pos = [], 0
        for slot in self.slots:
            if slot.offset > pos:
                out.append((pos, slot.offset))
            pos = slot.offset + slot.numel
        return out

    def slot(self, name: str) -> ParamSlot:
        if not self._by_name:
            self._by_name.update({s.name: s for s in self.slots})
        return self._by_name[name]

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "group": self.group,
            "dtype": self.dtype,
            "slots": [s.to_dict() for s in self.slots],
            "numel": self.numel,
            "padded_numel": self.padded_numel,
            "num_shards": self.num_shards,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FlatLayout:
        return cls(
            index=int(d["index"]),
            group=int(d["group"]),
            dtype=d["dtype"],
            slots=tuple(ParamSlot.from_dict(s) for s in d["slots"]),
            numel=int(d["numel"]),
            padded_numel=int(d["padded_numel"]),
            num_shards=int(d["num_shards"]),
        )


def plan_flat_buffers(
    params: Sequence[ParamSpec],
    *,
    num_shards: int,
    bucket_numel: int,
    align: int = DEFAULT_ALIGN,
    slot_align_bytes: int = 0,
) -> list[FlatLayout]:
    """Pack ``params`` (given in the order their gradients are expected) into flat buffers.

    A new flat buffer starts when the dtype or param group changes or when adding the next
    parameter would exceed ``bucket_numel`` elements. Each buffer is padded to a multiple of
    ``num_shards * align`` so every rank's shard is equal and starts aligned. With
    ``slot_align_bytes`` (the runtime passes ``SLOT_ALIGN_BYTES``) every parameter starts on such a
    boundary of its dtype's elements, leaving gaps between parameters.
    """
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    if bucket_numel < 1:
        raise ValueError("bucket_numel must be >= 1")
    layouts: list[FlatLayout] = []
    current: list[ParamSpec] = []

    def close() -> None:
        if not current:
            return
        slots = []
        offset = 0
        step = (
            max(1, slot_align_bytes // _ITEMSIZE.get(current[0].dtype, slot_align_bytes or 1))
            if slot_align_bytes
            else 1
        )
        for p in current:
            offset = round_up(offset, step)
            slots.append(ParamSlot(p.name, p.shape, p.dtype, offset, p.numel, p.aliases))
            offset += p.numel
        padded = round_up(max(offset, 1), num_shards * align)
        layouts.append(
            FlatLayout(
                index=len(layouts),
                group=current[0].group,
                dtype=current[0].dtype,
                slots=tuple(slots),
                numel=offset,
                padded_numel=padded,
                num_shards=num_shards,
            )
        )
        current.clear()

    used = 0
    for p in params:
        if current and (
            p.dtype != current[0].dtype or p.group != current[0].group or used + p.numel > bucket_numel
        ):
            close()
            used = 0
        current.append(p)
        used += p.numel
    close()
    return layouts
