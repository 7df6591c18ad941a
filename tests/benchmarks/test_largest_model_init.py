"""The memory `zerorun.initialize` needs at stage 3 with offload (benchmarks/largest_model_init.py:
one fresh process per measurement, the model built in fp32 on the host, the process's peaks reset
right before initialize).

* Host (CPU, and on the GPU machine): initialize's peak is what it keeps plus at most about one
  group's fp32 values -- not a second fp32 copy of every master (4 B/param; the build held all of
  them until the masters took them: 4.0 B/param measured here before the fix, 0.0 after).
* GPU (CUDA only; scripts/gpu_checks.sh runs it): with optimizer offload the fp32 master shards
  never touch the GPU -- its peak during initialize is a group's 16-bit gather buffer (parameters
  offloaded) or the 2 B/param at-rest shards (parameters on the GPU), far below the 4 B/param
  the masters would take.

With OUT set (scripts/gpu_checks.sh), each measured record is appended to $OUT/init_peak.jsonl.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import largest_model_init as lmi  # noqa: E402

# ~91M parameters, no group above ~8 % of them (a small vocabulary keeps the root group small).
CPU_MODEL = ["--layers", "12", "--hidden", "768", "--vocab", "4096", "--seq", "256"]
# ~320M parameters for the GPU check.
GPU_MODEL = ["--layers", "24", "--hidden", "1024", "--vocab", "8192", "--seq", "512"]


def _keep(rec: dict) -> None:
    """The measured record, also when the test passes: appended to $OUT/init_peak.jsonl when OUT
    is set (scripts/gpu_checks.sh's results folder)."""
    out = os.environ.get("OUT")
    if out and os.path.isdir(out):
        with open(os.path.join(out, "init_peak.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")


def test_initialize_host_peak_is_what_it_keeps() -> None:
    rec = lmi.run_child([*CPU_MODEL, "--optimizer", "cpu", "--param", "cpu"], timeout_s=240)
    _keep(rec)
    if not rec["host_peak_reset"]:
        pytest.skip("this kernel does not reset VmHWM (/proc/self/clear_refs)")
    psi = rec["params"]
    kept = (rec["host_rss_after_bytes"] - rec["host_rss_before_bytes"]) / psi
    transient = (rec["host_peak_bytes"] - rec["host_rss_after_bytes"]) / psi
    assert transient < 1.0, f"initialize's host peak is {transient:.2f} B/param above what it keeps: {rec}"
    # bf16 shard 2 + fp32 master 4 (+ staging/gradient pages touched), less the model it frees.
    assert rec["host_peak_growth_per_param"] < 8.0, rec
    assert kept > 1.0, rec  # the masters really were built in this process (the measurement sees them)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_checks.sh)")
@pytest.mark.parametrize(
    ("optimizer", "param", "build", "limit"),
    [
        ("cpu", "cpu", "host", 1.0),
        ("cpu", "cpu", "init", 1.0),
        ("nvme", "cpu", "host", 1.0),
        ("cpu", "none", "host", 3.0),  # the bf16 at-rest shards (2 B/param) stay on the GPU
    ],
)
def test_initialize_gpu_peak_has_no_fp32_master_term(
    tmp_path: Path, optimizer: str, param: str, build: str, limit: float
) -> None:
    args = [*GPU_MODEL, "--optimizer", optimizer, "--param", param, "--build", build]
    if optimizer == "nvme":
        args += ["--nvme-path", str(tmp_path)]
    rec = lmi.run_child(args, timeout_s=300)
    _keep(rec)
    growth = rec["gpu_peak_growth_per_param"]
    assert growth < limit, (
        f"GPU peak during initialize: {growth:.2f} B/param (>= {limit}; the fp32 masters are 4): {rec}"
    )
