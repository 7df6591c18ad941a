"""zerorun.checkpointing (DeepSpeed's activation checkpointing API): gradients against plain
PyTorch at every ZeRO stage on real ranks, plus single-process checks of the API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import zerorun.checkpointing as checkpointing
from zerorun.runtime.activations import current

from .._spawn import spawn_ranks

HERE = Path(__file__).resolve().parent
CASES = [f"stage{s}-{m}" for s in (0, 1, 2, 3) for m in ("plain", "cpu", "partition")]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("ckpt") / "results.json"
    spawn_ranks(HERE / "_ckpt_worker.py", 2, [str(out)], deadline_s=150)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_same_training_as_torch_checkpoint(results: dict[str, str], case: str) -> None:
    assert results.get(case) == "ok", results.get(case)


def test_dropout_replays_the_same_mask_and_gradients_match_no_checkpoint() -> None:
    checkpointing.reset()
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Tanh())
    x = torch.randn(5, 8, requires_grad=True)
    torch.manual_seed(7)
    plain = block(x).sum()
    plain.backward()
    want = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    torch.manual_seed(7)
    out = checkpointing.checkpoint(block, x)
    assert out.sum().item() == pytest.approx(plain.item())
    out.sum().backward()
    got = [p.grad for p in block.parameters()] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_configure_reads_a_deepspeed_config_and_arguments_override(tmp_path: Path) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"activation_checkpointing": {"cpu_checkpointing": True, "synchronize_checkpoint_boundary": True}}))
    try:
        checkpointing.configure(None, deepspeed_config=str(cfg))
        opts, part = current()
        assert opts.cpu_checkpointing and opts.synchronize and not opts.partition_activations and part is None
        checkpointing.configure(None, deepspeed_config=str(cfg), checkpoint_in_cpu=False)
        assert not current()[0].cpu_checkpointing
        with pytest.warns(UserWarning, match="partition_activations has no effect without a model-parallel group"):
            checkpointing.configure(None, partition_activations=True)
        assert checkpointing.is_configured()
    finally:
        checkpointing.reset()
    assert not checkpointing.is_configured()


def test_no_grad_runs_the_function_plainly() -> None:
    with torch.no_grad():
        assert torch.equal(checkpointing.checkpoint(torch.tanh, torch.ones(2)), torch.tanh(torch.ones(2)))


def test_profile_times_forward_and_recompute() -> None:
    from zerorun.runtime.activations import take_profile

    checkpointing.reset()
    take_profile()
    try:
        checkpointing.configure(None, profile=True)
        x = torch.randn(3, 4, requires_grad=True)
        for _ in range(2):
            checkpointing.checkpoint(torch.tanh, x).sum().backward()
        prof = take_profile()
        assert prof is not None and prof["forward_calls"] == 2 and prof["recompute_calls"] == 2
        assert prof["forward_ms"] >= 0 and prof["recompute_ms"] >= 0
        assert take_profile() is None  # taken
    finally:
        checkpointing.reset()
