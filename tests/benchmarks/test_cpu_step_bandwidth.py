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
    # zerorun's kernel (bf16 gradient, 26 B/element) on its thread pool and under OpenMP: the
    # test machines have a C compiler (scripts/bootstrap.sh --system)
    kernel = {f"kernel_bf16_grad_{k}_{m}" for k in ("tiles", "whole") for m in ("threads", "omp")}
    assert set(rec["adam"]) == {"zerorun_tiles", "fused_whole", "torch_default_adamw"} | kernel
    assert all(rec["adam"][k]["bytes_per_element"] == 26 for k in kernel)
    for row in [*rec["stream"].values(), *rec["adam"].values()]:
        assert row["best_s"] > 0 and row["median_s"] >= row["best_s"]
        assert abs(row["GBps"] - row["bytes_per_element"] * rec["numel"] / row["best_s"] / 1e9) < 1e-6 * row["GBps"]
    assert rec["stream_best_GBps"] == max(r["GBps"] for r in rec["stream"].values())
    steps = rec["offloaded_step_bytes_per_element"]
    assert steps["total"] == sum(v["bytes"] for k, v in steps.items() if k != "total") == 36
    assert steps["adam_read"]["bytes"] + steps["adam_write"]["bytes"] == 28
    narrow = rec["offloaded_step_bytes_per_element_bf16_gradient"]
    assert narrow["total"] == sum(v["bytes"] for k, v in narrow.items() if k != "total") == 32
    assert "STREAM best" in done.stdout


def test_cpu_step_bandwidth_sweep(tmp_path: Path) -> None:
    """--sweep: one child per (threads, pin mode), each pinned as asked; the variants timed."""
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "cpu_step_bandwidth.py"), "--sweep", "1", "--pin", "none,affinity",
           "--numel", "64K", "--rounds", "1", "--variants", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    rec = json.loads(out.read_text())
    assert [(r["threads"], r["pin"]) for r in rec["summary"]] == [(1, "none"), (1, "affinity")]
    none, affinity = rec["runs"]
    assert none["pinned_cores"] is None and len(affinity["pinned_cores"]) == 1
    variants = {"tiles_1M", "tiles_4M", "tiles_on_worker_thread", "tiles_4M_then_cast_bf16", "bf16_grad_widened_256K",
                "bf16_grad_widened_2M", "bf16_grad_widened_256K_py_threads", "tiles_1M_py_threads"}  # fmt: skip
    kernel = {f"kernel_bf16_grad_{k}_{m}" for k in ("tiles", "whole") for m in ("threads", "omp")}
    assert variants | kernel | {"zerorun_tiles", "fused_whole"} == set(affinity["adam"])
    assert affinity["adam"]["bf16_grad_widened_256K"]["bytes_per_element"] == 26
    assert rec["summary"][1]["zerorun_tiles_GBps"] > 0 and "wrote" in done.stdout
    bad = subprocess.run([*cmd[:4], "--pin", "wild"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert bad.returncode != 0 and "unknown mode 'wild'" in bad.stderr + bad.stdout
