"""The engine's own data loader continues where a checkpoint says (checkpoint/data_position.py).
Pure: samplers with explicit rank/world, no process group."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from zerorun.runtime.checkpoint.data_position import ResumableLoader, ResumableSampler

DATA = TensorDataset(torch.arange(40))


def _loader(rank: int, world: int, batch: int = 2) -> ResumableLoader:
    return ResumableLoader(DATA, batch_size=batch, sampler=ResumableSampler(DATA, num_replicas=world, rank=rank, seed=3))


def _ids(batches: list) -> list[list[int]]:
    return [b[0].tolist() for b in batches]


def test_same_world_size_continues_with_the_next_batch() -> None:
    for rank in (0, 1):
        full = _ids(list(_loader(rank, 2)))
        first = _loader(rank, 2)
        first.sampler.set_epoch(0)
        it = iter(first)
        seen = [next(it) for _ in range(3)]
        position = first.position(world_size=2)
        assert position == {"epoch": 0, "samples": 3 * 2 * 2}
        resumed = _loader(rank, 2)
        assert resumed.resume_at(position, world_size=2) == 3 and resumed.resume_skip == 3
        rest = list(resumed)
        assert _ids(seen) + _ids(rest) == full
        assert resumed.batches_this_pass == len(full)  # the count goes on from the skipped batches
        assert resumed.resume_skip == 0 and _ids(list(resumed)) == full  # the next pass is whole again


def test_epoch_is_restored_and_another_world_size_skips_as_many_samples() -> None:
    first = _loader(0, 2)
    first.sampler.set_epoch(4)
    it = iter(first)
    for _ in range(5):
        next(it)
    position = first.position(world_size=2)
    assert position == {"epoch": 4, "samples": 20}
    # one rank now (a node lost): the 20 samples the two ranks consumed are 10 batches of 2
    alone = _loader(0, 1)
    assert alone.resume_at(position, world_size=1) == 10
    assert alone.sampler.epoch == 4
    rest = list(alone)
    assert len(rest) == 10
    expected = _loader(0, 1)
    expected.sampler.set_epoch(4)
    assert _ids(rest) == _ids(list(expected))[10:]
