"""flops_profiler: FLOPs of a model whose count is known in closed form (2·B·in·out per Linear
forward; backward: weight gradients, plus input gradients where the input needs one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import json, sys
import torch
from torch import nn
import zerorun

reports = {}
for stage in (0, 3):  # stage 3: parameters are empty placeholders outside their forward
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    config = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "flops_profiler": {"enabled": True, "profile_step": 1, "top_modules": 2, "output_file": sys.argv[1]},
        "steps_per_print": 100,
    }
    engine, *_ = zerorun.initialize(model=model, config=config)
    for step in range(3):
        for _ in range(2):
            loss = engine(torch.randn(4, 16, device=engine.device)).square().mean()
            engine.backward(loss)
            engine.step()
    report = engine.reporter.profiler.last_report
    report["modules"] = {m["name"]: m for m in report["modules"]}
    reports[stage] = report
    engine.destroy()
print("REPORT " + json.dumps(reports))
"""


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, dict], str]:
    tmp_path = tmp_path_factory.mktemp("flops")
    out_file = tmp_path / "flops.txt"
    # The caller's PYTHONPATH stays behind the repo: the GPU machine brings pydantic that way.
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    cuda = os.environ.get("ZERORUN_TEST_DEVICE") == "cuda"  # scripts/gpu_checks.sh: CUDA events, a known peak
    if cuda:
        env.update(ZERORUN_DEVICE="cuda", CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out_file)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.split("REPORT ", 1)[1]), out_file.read_text()


@pytest.mark.parametrize("stage", ["0", "3"])
def test_flops_match_the_closed_form(reports: tuple[dict[str, dict], str], stage: str) -> None:
    report, text = reports[0][stage], reports[1]
    cuda = os.environ.get("ZERORUN_TEST_DEVICE") == "cuda"
    b, micro_steps = 4, 2
    fwd = micro_steps * (2 * b * 16 * 32 + 2 * b * 32 * 8)
    # layer 0: weight gradient only (its input needs none); layer 2: weight and input gradients
    bwd = micro_steps * (2 * b * 16 * 32 + 2 * (2 * b * 32 * 8))
    assert report["step"] == 2 and report["micro_steps"] == micro_steps  # the step after profile_step steps
    assert report["fwd_flops"] == fwd and report["bwd_flops"] == bwd
    assert report["params"] == 16 * 32 + 32 + 32 * 8 + 8
    mods = report["modules"]
    assert mods["Sequential.0"]["fwd_flops"] == micro_steps * 2 * b * 16 * 32
    assert mods["Sequential.2"]["bwd_flops"] == micro_steps * 4 * b * 32 * 8
    assert mods["Sequential.0"]["fwd_ms"] > 0 and report["fwd_ms"] > 0 and report["achieved_flops_per_s"] > 0
    assert (report["mfu"] is not None and 0 < report["mfu"] < 1) if cuda else report["mfu"] is None  # CPU: no peak
    assert "zerorun flops profiler" in text and "step 2" in text
    assert "top 2 module(s) at depth 1 by fwd+bwd FLOPs:" in text
    assert "  Sequential.0: " in text and ("MFU: " in text if cuda else "MFU: -" in text)
