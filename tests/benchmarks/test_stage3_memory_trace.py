"""benchmarks/stage3_memory_trace.py at one rank (issue 20): zerorun stage 3 with its real
collective path (ZERORUN_DEBUG_COLLECTIVES=1) peaks no higher than FSDP2 within the training
step, with only the root group gathered at the peak (no block kept after its forward or
prefetched into the loss's backward); both train the same losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _trace(system: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.stage3_memory_trace", "--system", system, "--out", str(out)]
    env = {**os.environ, "ZERORUN_DEBUG_COLLECTIVES": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def test_one_rank_real_collectives_peak_at_most_fsdp2(tmp_path: Path) -> None:
    fsdp2 = _trace("fsdp2", tmp_path / "fsdp2.json")
    zr = _trace("zerorun", tmp_path / "zerorun.json")
    assert zr["schedule"]["prefetches"] == 0
    for r in (fsdp2, zr):
        # the peak is in the loss (the fp32 logits, their log-softmax and its gradient)
        assert r["peak_after_mark"] == "fwd7.end", r["peak_after_mark"]
    gathered = [x for x in zr["live_at_peak"] if "params" in x["what"]]
    assert [x["what"].split(" (")[0] for x in gathered] == ["root group params, bf16"], gathered
    assert zr["peak_bytes_step"] <= fsdp2["peak_bytes_step"], (zr["peak_bytes_step"], fsdp2["peak_bytes_step"])
    for a, b in zip(zr["losses"], fsdp2["losses"], strict=True):
        assert abs(a - b) <= 2e-2 * abs(b), (zr["losses"], fsdp2["losses"])
