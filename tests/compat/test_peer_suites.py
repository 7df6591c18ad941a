"""The peer DeepSpeed suites (Hugging Face transformers' Trainer DeepSpeed tests and accelerate's
tests/deepspeed) under zerorun's layer on a CPU rank, when ``ZERORUN_PEER_SUITES`` names the
directory holding them (``.ci/run`` sets it to ../shared/peer-suites when that exists). Runs
scripts/peer_suites/run.py: GPU-only gates lifted where meaningful on CPU, hub models replaced
by random stand-ins; fails on any failing test that scripts/peer_suites/gates.py does not list
as known (with its reason), so a regression or an upstream change shows up here."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ._run import PYTHON, ROOT, env

SUITES = os.environ.get("ZERORUN_PEER_SUITES")

pytestmark = pytest.mark.skipif(
    not SUITES,
    reason="ZERORUN_PEER_SUITES is not set: the peer DeepSpeed suites (transformers, accelerate) are not run; "
    "set it to the directory holding them (.ci/run uses ../shared/peer-suites when it exists)",
)


@pytest.mark.parametrize("suite", ["accelerate", "transformers"])
def test_peer_suite_passes_under_the_layer(suite: str, tmp_path: Path) -> None:
    suites = Path(SUITES or "")
    if not (suites / suite).is_dir():
        pytest.fail(f"ZERORUN_PEER_SUITES={SUITES} has no {suite}/ directory")
    out = tmp_path / "peer"
    proc = subprocess.run(
        [PYTHON, "scripts/peer_suites/run.py", "--suites", str(suites), "--only", suite, "--out", str(out)],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1200,
    )
    summary = json.loads((out / "summary.json").read_text())[suite] if (out / "summary.json").is_file() else {}
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{json.dumps(summary, indent=1)[:4000]}"
    assert summary["passed"] > 0
