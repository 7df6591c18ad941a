"""benchmarks/cpu_step_bandwidth.py on a small size: the record has every kernel, positive
bandwidths from the measured times, and the offloaded step's byte account adds up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_cpu_step_bandwidth_record(tmp_path: Path) -> None:
    out = tmp_path / "bw.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "cpu_step_bandwidth.py"), "--numel", "256K", "--rounds", "2",
           "--threads", "1", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    rec = json.loads(out.read_text())
    assert rec["numel"] == 256 * 1024 and rec["threads"] == 1
    assert set(rec["stream"]) == {"copy", "scale", "add", "triad"}
    assert set(rec["adam"]) == {"zerorun_tiles", "fused_whole", "torch_default_adamw"}
    for row in [*rec["stream"].values(), *rec["adam"].values()]:
        assert row["best_s"] > 0 and row["median_s"] >= row["best_s"]
        assert abs(row["GBps"] - row["bytes_per_element"] * rec["numel"] / row["best_s"] / 1e9) < 1e-6 * row["GBps"]
    assert rec["stream_best_GBps"] == max(r["GBps"] for r in rec["stream"].values())
    steps = rec["offloaded_step_bytes_per_element"]
    assert steps["total"] == sum(v["bytes"] for k, v in steps.items() if k != "total") == 36
    assert steps["adam_read"]["bytes"] + steps["adam_write"]["bytes"] == 28
    assert "STREAM best" in done.stdout
