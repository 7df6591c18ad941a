"""DeepSpeed scripts (`import deepspeed`, engine.backward / engine.step of the compat engine) get
the same reports and monitors as zerorun's own engine: steps_per_print lines, the wall-clock
breakdown, csv_monitor rows equal to the script's losses. One process, world 1."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from ._run import run

SCRIPT = r"""
import json, sys
import torch
import zerorun.compat
zerorun.compat.activate(announce=False)
import deepspeed

out = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
config = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "steps_per_print": 2, "wall_clock_breakdown": True,
    "csv_monitor": {"enabled": True, "output_path": out, "job_name": "ds"},
}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
# Host syncs on the hot path: zerorun's own code calls no .item() in these fp32 steps (the
# report reads its values in one go; the grad norm is read when the script asks for it).
import os, zerorun
own = os.path.dirname(zerorun.__file__) + os.sep
syncs = []
item = torch.Tensor.item
def counted(self):
    caller = sys._getframe(1).f_code.co_filename
    if caller.startswith(own):
        syncs.append(caller)
    return item(self)
torch.Tensor.item = counted
losses, cur = [], []
for i in range(8):  # 4 optimizer steps
    x = torch.randn(4, 8)
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()
    cur.append(float(loss.detach()))
    if len(cur) == 2:
        losses.append(sum(cur) / 2)
        cur = []
torch.Tensor.item = item
print("LOSSES " + json.dumps(losses), flush=True)
print("SYNCS " + json.dumps(syncs), flush=True)
print("NORM " + json.dumps(engine.get_global_grad_norm()), flush=True)
"""


def test_compat_engine_reports_and_monitors(tmp_path: Path) -> None:
    proc = run(["-c", SCRIPT, str(tmp_path)], timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[Rank 0] step=")]
    assert [line.split(",")[0] for line in lines] == ["[Rank 0] step=2", "[Rank 0] step=4"], proc.stdout
    assert sum("[Rank 0] time (ms) | fwd:" in line for line in proc.stdout.splitlines()) == 2
    losses = json.loads(proc.stdout.split("LOSSES ", 1)[1].splitlines()[0])
    rows = list(csv.reader((tmp_path / "ds" / "Train_Samples_train_loss.csv").open()))
    assert rows[0] == ["step", "train_loss"]
    assert [int(r[0]) for r in rows[1:]] == [8, 16, 24, 32]  # samples seen, as DeepSpeed
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(losses, rel=1e-5)
    assert json.loads(proc.stdout.split("SYNCS ", 1)[1].splitlines()[0]) == []
    norm = json.loads(proc.stdout.split("NORM ", 1)[1].splitlines()[0])
    assert isinstance(norm, float) and 0.0 < norm < float("inf")
