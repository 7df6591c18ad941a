"""Pure partition math (no processes)."""

from __future__ import annotations

import json

import pytest

from zerorun.runtime.partition import DEFAULT_ALIGN, FlatLayout, ParamSpec, plan_flat_buffers


def specs() -> list[ParamSpec]:
    return [
        ParamSpec("a", (3, 7), "bfloat16"),
        ParamSpec("b", (5,), "bfloat16"),
        ParamSpec("c", (101,), "bfloat16", aliases=("c2",)),
        ParamSpec("d", (2, 3), "bfloat16", group=1),
        ParamSpec("e", (9,), "float32", group=1),
    ]


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 8])
def test_shards_equal_aligned_and_cover_everything(shards: int) -> None:
    layouts = plan_flat_buffers(specs(), num_shards=shards, bucket_numel=30)
    seen: dict[str, int] = {}
    for layout in layouts:
        assert layout.padded_numel % (shards * DEFAULT_ALIGN) == 0
        assert layout.padded_numel >= layout.numel
        assert layout.padded_numel - layout.numel < shards * DEFAULT_ALIGN or layout.numel == 0
        ranges = [layout.shard_range(r) for r in range(shards)]
        assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
        assert all(b - a == layout.shard_numel for a, b in ranges)
        assert all(ranges[i][1] == ranges[i + 1][0] for i in range(shards - 1))
        # Every parameter element is in exactly one shard.
        for a, b in ranges:
            for slot, lo, hi in layout.pieces_in_range(a, b):
                seen[slot.name] = seen.get(slot.name, 0) + (hi - lo)
    assert seen == {s.name: s.numel for s in specs()}


def test_buffers_split_on_size_dtype_and_group() -> None:
    layouts = plan_flat_buffers(specs(), num_shards=2, bucket_numel=30)
    names = [[s.name for s in layout.slots] for layout in layouts]
    # a+b fit in 30; c (101) alone exceeds the bucket and gets its own buffer; d starts group 1;
    # e is another dtype.
    assert names == [["a", "b"], ["c"], ["d"], ["e"]]
    assert [layout.group for layout in layouts] == [0, 0, 1, 1]
    assert layouts[1].slots[0].aliases == ("c2",)
    assert [s.offset for s in layouts[0].slots] == [0, 21]


def test_piece_offsets_are_inside_the_parameter() -> None:
    (layout,) = plan_flat_buffers(
        [ParamSpec("w", (10,), "float32"), ParamSpec("v", (10,), "float32")],
        num_shards=4,
        bucket_numel=100,
        align=1,
    )
    # 20 elements padded to 20, shards of 5: shard 1 = [5, 10) of w; shard 2 = [10, 15) = v[0:5].
    assert layout.padded_numel == 20
    assert [(s.name, lo, hi) for s, lo, hi in layout.pieces_in_range(*layout.shard_range(1))] == [
        ("w", 5, 10)
    ]
    assert [(s.name, lo, hi) for s, lo, hi in layout.pieces_in_range(8, 13)] == [("w", 8, 10), ("v", 0, 3)]


def test_layout_round_trips_through_json() -> None:
    for layout in plan_flat_buffers(specs(), num_shards=3, bucket_numel=50):
        again = FlatLayout.from_dict(json.loads(json.dumps(layout.to_dict())))
        assert again == layout
        assert again.slot("a" if "a" in {s.name for s in layout.slots} else layout.slots[0].name)


def test_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        plan_flat_buffers(specs(), num_shards=0, bucket_numel=10)
    with pytest.raises(ValueError):
        plan_flat_buffers(specs(), num_shards=2, bucket_numel=10).__getitem__(0).shard_range(2)


def test_slot_alignment_starts_every_parameter_on_16_bytes() -> None:
    """The runtime's layouts (SLOT_ALIGN_BYTES): every parameter view starts 16-byte aligned in
    its buffer (compiled kernels assume it), the gaps between them are listed, nothing overlaps."""
    from zerorun.runtime.partition import SLOT_ALIGN_BYTES

    layouts = plan_flat_buffers(specs(), num_shards=2, bucket_numel=1000, slot_align_bytes=SLOT_ALIGN_BYTES)
    bf16 = layouts[0]
    assert [s.offset for s in bf16.slots] == [0, 24, 32]  # 21 -> 24, 21 + 5 = 29 -> 32 (8 bf16 = 16 bytes)
    assert bf16.gaps() == [(21, 24), (29, 32)]
    assert bf16.numel == 32 + 101 and bf16.padded_numel % (2 * DEFAULT_ALIGN) == 0
    assert [s.offset for s in layouts[1].slots] == [0]  # group 1 starts a buffer
    assert [s.offset for s in layouts[2].slots] == [0] and layouts[2].dtype == "float32"
    for layout in layouts:
        width = {"bfloat16": 2, "float32": 4}[layout.dtype]
        assert all(s.offset * width % SLOT_ALIGN_BYTES == 0 for s in layout.slots)
        ends = [(s.offset, s.offset + s.numel) for s in layout.slots]
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:], strict=False))
    # Without it (the default) parameters are packed back to back.
    assert [s.offset for s in plan_flat_buffers(specs(), num_shards=2, bucket_numel=1000)[0].slots] == [
        0,
        21,
        26,
    ]
