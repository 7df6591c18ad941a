"""``get_accelerator().manual_seed`` / ``manual_seed_all`` seed what DeepSpeed's accelerator
seeds: on CUDA only the GPU generators (``torch.cuda.manual_seed[_all]``), leaving the CPU's
stream alone (data order, CPU-side init); on the CPU accelerator the CPU's. The GPU path differs
from a CPU rank here, so the CUDA branch is checked with torch.cuda's seeding functions recorded
on a CPU machine, and for real on a GPU."""

from __future__ import annotations

import pytest
import torch

from zerorun.compat.deepspeed.accelerator import Accelerator


def _accelerator(cuda: bool) -> Accelerator:
    acc = Accelerator()
    acc._cuda = cuda  # the device the rank trains on (ZERORUN_DEVICE / CUDA availability)
    acc._name = "cuda" if cuda else "cpu"
    return acc


def test_on_the_cpu_accelerator_the_cpu_generator_is_seeded() -> None:
    acc = _accelerator(cuda=False)
    for seed_fn in (acc.manual_seed, acc.manual_seed_all):
        torch.manual_seed(123)
        want = torch.rand(4)
        torch.manual_seed(7)
        seed_fn(123)
        assert torch.equal(torch.rand(4), want)


@pytest.mark.parametrize("name", ["manual_seed", "manual_seed_all"])
def test_on_cuda_only_the_gpu_generators_are_seeded(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    acc = _accelerator(cuda=True)
    seen: list[tuple[str, int]] = []
    torch.manual_seed(5)  # (itself calls torch.cuda.manual_seed_all: before the recording starts)
    cpu_before = torch.get_rng_state()
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "manual_seed", lambda s: seen.append(("manual_seed", s)))
        monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda s: seen.append(("manual_seed_all", s)))
    getattr(acc, name)(99)
    assert torch.equal(torch.get_rng_state(), cpu_before)  # the CPU stream is where it was
    if torch.cuda.is_available():
        got = torch.rand(4, device="cuda")
        getattr(torch.cuda, name)(99)
        assert torch.equal(got, torch.rand(4, device="cuda"))
    else:
        assert seen == [(name, 99)]
