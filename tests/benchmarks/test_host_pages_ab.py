"""benchmarks/host_pages_ab.py on a small size: every (pages, load) variant timed, what the
kernel backed with huge pages and the machine recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_host_pages_ab_record(tmp_path: Path) -> None:
    out = tmp_path / "hp.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "host_pages_ab.py"), "--numel", str(4 << 20), "--rounds", "2",
           "--threads", "2", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    rec = json.loads(out.read_text())
    assert rec["numel"] == 4 << 20 and rec["threads"] == 2
    # no CUDA here: no copy variants; both page sizes, alone and beside a GIL-busy thread
    assert {(r["pages"], r["load"]) for r in rec["rows"]} == {(p, lo) for p in ("4k", "huge") for lo in ("alone", "busy")}
    for row in rec["rows"]:
        assert 0 < row["best_s"] <= row["median_s"]
        assert abs(row["G_elements_per_s_median"] - rec["numel"] / row["median_s"] / 1e9) < 1e-9
    # what the kernel backed with huge pages depends on its policy and free memory (whether the
    # advice is given is tests/runtime/test_offload_host.py's): recorded for every array
    for pages in ("4k", "huge"):
        assert set(rec["huge_bytes_per_array"][pages]) == {"p", "g", "m", "v"}
        assert all(isinstance(v, int) and v >= 0 for v in rec["huge_bytes_per_array"][pages].values())
    assert {"thp_enabled", "cpu", "llc", "cores"} <= set(rec["machine"])
