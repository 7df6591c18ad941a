"""A script that calls `loss.backward()` itself with gradient accumulation trains like plain
PyTorch at every stage and with CPU optimizer offload (2 real ranks on gloo)."""

from __future__ import annotations

import json
from pathlib import Path

from ._spawn import spawn_ranks

HERE = Path(__file__).parent


def test_loss_backward_with_accumulation_matches_plain_pytorch() -> None:
    results = spawn_ranks(HERE / "_plain_backward_worker.py", 2, [], deadline_s=120)
    line = next(ln for ln in results[0][1].splitlines() if ln.startswith("RESULT "))
    errors = json.loads(line[len("RESULT "):])
    assert set(errors) == {"stage0", "stage1", "stage2", "stage3", "stage2_offload"}
    for name, err in errors.items():
        assert err < 1e-5, f"{name}: weights differ from plain PyTorch by {err}"
    line = next(ln for ln in results[0][1].splitlines() if ln.startswith("REFUSED "))
    for name, message in json.loads(line[len("REFUSED "):]).items():
        assert message.startswith("RuntimeConfigError") and "twice in one backward" in message, (name, message)
        assert "use_reentrant=False" in message
