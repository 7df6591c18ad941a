"""Format and reshard math: save under one rank layout, read under any other (one process)."""

from __future__ import annotations

import pytest
import torch

from zerorun.errors import CheckpointError
from zerorun.runtime.checkpoint.format import (
    META_FILE,
    WEIGHT,
    CheckpointMeta,
    Fragment,
    even_chunk,
    owned_pieces,
    shard_file,
)
from zerorun.runtime.checkpoint.store import CheckpointReader, write_rank_shard

from ._layout import meta_for, model_state, rank_fragments

# sizes not divisible by 2 or 4; one parameter larger than a bucket
SIZES = {"emb.weight": (11, 7), "l1.weight": (13, 11), "l1.bias": (13,), "l2.weight": (5, 13), "l2.bias": (5,), "s": (1,)}


def _save(tmp_path, state, *, world_size, stage, bucket_numel, buffers=None):
    for r in range(world_size):
        frags = rank_fragments(state, world_size=world_size, rank=r, stage=stage, bucket_numel=bucket_numel, buffers=buffers)
        write_rank_shard(tmp_path, r, world_size, frags)
    (tmp_path / META_FILE).write_text(meta_for(state, world_size=world_size, stage=stage, buffers=buffers).to_json())


def test_even_chunk_covers_exactly():
    for numel in (0, 1, 5, 64, 65):
        for w in (1, 2, 3, 4, 7):
            pieces = [even_chunk(numel, r, w) for r in range(w)]
            covered = [i for s, e in pieces for i in range(s, e)]
            assert covered == list(range(numel))


def test_owned_pieces_split_replicated_and_keep_partitioned():
    t = torch.arange(10.0)
    frags = [Fragment("a", WEIGHT, 0, 10, t, replicated=True), Fragment("b", WEIGHT, 3, 7, t[3:7])]
    got = [(f.name, s, e) for f, s, e in owned_pieces(frags, 1, 3)]
    assert got == [("a", 4, 8), ("b", 3, 7)]
    assert [(f.name, s, e) for f, s, e in owned_pieces(frags, 2, 3)] == [("a", 8, 10), ("b", 3, 7)]
    # buffers may differ between ranks (BatchNorm statistics): rank 0 writes them whole
    buf = [Fragment("bn.running_mean", "buffer", 0, 10, t, replicated=True)]
    assert [(s, e) for _, s, e in owned_pieces(buf, 0, 3)] == [(0, 10)]
    assert owned_pieces(buf, 1, 3) == [] and owned_pieces(buf, 2, 3) == []


@pytest.mark.parametrize(
    ("save_world", "save_stage", "load_world", "load_stage"),
    [(2, 2, 4, 3), (2, 2, 1, 0), (4, 1, 2, 2), (1, 0, 3, 1), (3, 2, 3, 2)],
)
def test_reshard_any_layout(tmp_path, save_world, save_stage, load_world, load_stage):
    state = model_state(SIZES)
    buffers = {"bn.running_mean": torch.randn(6), "bn.num_batches_tracked": torch.tensor(7)}
    _save(tmp_path, state, world_size=save_world, stage=save_stage, bucket_numel=100, buffers=buffers)
    with CheckpointReader(tmp_path) as rd:
        assert rd.meta.world_size == save_world and rd.meta.stage == save_stage
        assert rd.kinds() == {WEIGHT, "optim.exp_avg", "optim.exp_avg_sq", "buffer"}
        # every rank of the new layout (other bucket size too) gets exactly its values
        for r in range(load_world):
            zeros = {k: {n: torch.zeros_like(t) for n, t in d.items()} for k, d in state.items()}
            zbuf = {n: torch.zeros_like(t) for n, t in buffers.items()}
            frags = rank_fragments(zeros, world_size=load_world, rank=r, stage=load_stage, bucket_numel=77, buffers=zbuf)
            for f in frags:
                rd.read_into(f.name, f.kind, f.start, f.end, f.tensor)
            for f in frags:
                src = state[f.kind][f.name] if f.kind != "buffer" else buffers[f.name]
                assert torch.equal(f.tensor, src.reshape(-1)[f.start : f.end]), (f.name, f.kind, f.start)
        # whole tensors in another dtype (what consolidation does)
        full = rd.read_full("l1.weight", WEIGHT, dtype=torch.bfloat16)
        assert torch.equal(full, state[WEIGHT]["l1.weight"].reshape(-1).bfloat16())
        assert rd.read_full("bn.num_batches_tracked", "buffer").item() == 7


def test_reader_reports_missing_ranges_and_files(tmp_path):
    state = model_state(SIZES)
    _save(tmp_path, state, world_size=2, stage=2, bucket_numel=100)
    # rank 1's shard replaced by an empty one: its ranges are nowhere
    write_rank_shard(tmp_path, 1, 2, [])
    with CheckpointReader(tmp_path) as rd, pytest.raises(CheckpointError, match="in no shard file"):
        for n in SIZES:
            rd.read_full(n)
    (tmp_path / shard_file(1)).unlink()
    with pytest.raises(CheckpointError, match="missing 1 shard file"):
        CheckpointReader(tmp_path)
    (tmp_path / META_FILE).unlink()
    with pytest.raises(CheckpointError, match="not a complete zerorun checkpoint"):
        CheckpointReader(tmp_path)


def test_meta_roundtrip_and_newer_format_refused(tmp_path):
    state = model_state(SIZES)
    meta = meta_for(state, world_size=2, stage=2, tied={"head.weight": "emb.weight"})
    back = CheckpointMeta.from_json(meta.to_json(), "x")
    assert back == meta
    import json

    d = json.loads(meta.to_json())
    d["format_version"] = 99
    with pytest.raises(CheckpointError, match="newer than this zerorun"):
        CheckpointMeta.from_json(json.dumps(d), "m.json")
    with pytest.raises(CheckpointError, match="not a zerorun checkpoint"):
        CheckpointMeta.from_json('{"a": 1}', "m.json")


def test_many_rank_files_bounded_descriptors(tmp_path):
    """A checkpoint saved by 20 ranks, read under a 3-rank layout: every value right, never more
    than 16 shard files open at once."""
    state = model_state(SIZES, seed=3)
    _save(tmp_path, state, world_size=20, stage=2, bucket_numel=40)
    peak = 0
    with CheckpointReader(tmp_path) as rd:
        for r in range(3):
            zeros = {k: {n: torch.zeros_like(t) for n, t in d.items()} for k, d in state.items()}
            for f in rank_fragments(zeros, world_size=3, rank=r, stage=3, bucket_numel=1000):
                rd.read_into(f.name, f.kind, f.start, f.end, f.tensor)
                assert torch.equal(f.tensor, state[f.kind][f.name].reshape(-1)[f.start : f.end])
                peak = max(peak, _open_shard_files())
    assert 3 < peak <= 16
    assert _open_shard_files() == 0


def _open_shard_files() -> int:
    import os

    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "shard_rank" in os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the descriptor listdir itself used
            pass
    return n
