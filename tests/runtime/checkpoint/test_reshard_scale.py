"""The checkpoint reshard plan at 1,024 and 8,192 ranks (pure: no files, no processes).

A 1.3B-parameter GPT's fp32 masters are partitioned as stages 1-3 partition them
(`runtime/partition.py`: flat buffers cut into one shard per rank, each shard a run of
parameter pieces); every rank's pieces are the fragments it saves. Loading at another world
size asks, per rank, for the pieces of its new shards, resolved against the saved fragments
by `store.covering` (what `CheckpointReader.read_into` reads). Checked: every element of every
parameter is saved exactly once and read exactly once, and planning stays fast."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

from zerorun.runtime.checkpoint.format import WEIGHT, FragmentRecord, shard_file
from zerorun.runtime.checkpoint.store import covering
from zerorun.runtime.partition import ParamSpec, plan_flat_buffers

BUCKET = 50_000_000  # DeepSpeed's reduce_bucket_size default, zerorun's MAX_FLAT_NUMEL


def gpt_1_3b() -> list[ParamSpec]:
    h, v, seq, layers = 2048, 32000, 2048, 24
    params = [ParamSpec("wte", (v, h), "float32"), ParamSpec("wpe", (seq, h), "float32")]
    for i in range(layers):
        p = f"h.{i}."
        params += [ParamSpec(p + "ln1.weight", (h,), "float32"), ParamSpec(p + "ln1.bias", (h,), "float32"),
                   ParamSpec(p + "attn.qkv", (3 * h, h), "float32"), ParamSpec(p + "attn.proj", (h, h), "float32"),
                   ParamSpec(p + "ln2.weight", (h,), "float32"), ParamSpec(p + "ln2.bias", (h,), "float32"),
                   ParamSpec(p + "mlp.fc", (4 * h, h), "float32"), ParamSpec(p + "mlp.proj", (h, 4 * h), "float32")]
    params += [ParamSpec("ln_f.weight", (h,), "float32"), ParamSpec("ln_f.bias", (h,), "float32"),
               ParamSpec("head", (v, h), "float32")]
    return params[::-1]  # gradients arrive in reverse registration order


def saved_fragments(params: list[ParamSpec], world: int) -> dict[str, list[FragmentRecord]]:
    """Every rank's pieces of its shards, as the fragment index of its shard file."""
    index: dict[str, list[FragmentRecord]] = defaultdict(list)
    for layout in plan_flat_buffers(params, num_shards=world, bucket_numel=BUCKET):
        for rank in range(world):
            for slot, lo, hi in layout.pieces_in_range(*layout.shard_range(rank)):
                index[slot.name].append(FragmentRecord(slot.name, WEIGHT, lo, hi, shard_file(rank), slot.name))
    for recs in index.values():
        recs.sort(key=lambda r: r.start)
    return index


def exactly_once(pieces: list[tuple[int, int]], numel: int) -> bool:
    pieces = sorted(pieces)
    return bool(pieces) and pieces[0][0] == 0 and pieces[-1][1] == numel and all(
        a[1] == b[0] for a, b in zip(pieces, pieces[1:])  # noqa: B905 - one shorter
    )


@pytest.mark.parametrize("saved_world,load_world", [(1024, 8192), (8192, 1000)])
def test_every_element_is_saved_once_and_read_once(saved_world: int, load_world: int) -> None:
    params = gpt_1_3b()
    numel = {p.name: p.numel for p in params}
    assert sum(numel.values()) == 1_343_426_560  # the README model's 1.3B (benchmarks/README.md)
    t0 = time.monotonic()
    index = saved_fragments(params, saved_world)
    starts = {name: [r.start for r in recs] for name, recs in index.items()}
    for name, recs in index.items():
        assert exactly_once([(r.start, r.end) for r in recs], numel[name]), name
    read: dict[str, list[tuple[int, int]]] = defaultdict(list)
    files_per_rank: list[int] = []
    for layout in plan_flat_buffers(params, num_shards=load_world, bucket_numel=BUCKET):
        for rank in range(load_world):
            files: set[str] = set()
            for slot, lo, hi in layout.pieces_in_range(*layout.shard_range(rank)):
                pieces, covered = covering(index[slot.name], starts[slot.name], lo, hi)
                assert covered == hi
                for rec, a, b in pieces:
                    assert rec.start <= a < b <= rec.end  # inside the fragment it is read from
                    read[slot.name].append((a, b))
                    files.add(rec.file)
            files_per_rank.append(len(files))
    elapsed = time.monotonic() - t0
    for name, n in numel.items():
        assert exactly_once(read[name], n), name
    # a rank reads from the few ranks whose old shards overlap its new ones, not from all
    ratio = max(1, saved_world // load_world)
    assert max(files_per_rank) <= 2 * (ratio + 1) * 2
    assert elapsed < 30.0, elapsed


def test_a_gap_in_the_saved_fragments_is_reported() -> None:
    recs = [FragmentRecord("w", WEIGHT, 0, 10, "a", "w"), FragmentRecord("w", WEIGHT, 12, 20, "b", "w")]
    pieces, covered = covering(recs, [0, 12], 5, 18)
    assert [(p[0].file, p[1], p[2]) for p in pieces] == [("a", 5, 10)] and covered == 10
    pieces, covered = covering(recs, [0, 12], 13, 20)
    assert [(p[0].file, p[1], p[2]) for p in pieces] == [("b", 13, 20)] and covered == 20
