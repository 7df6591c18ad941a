"""DeepSpeed's `engine.compile()` through the compat layer: the wrapped model is compiled in place
(`is_compiled`), and training gives the same losses as without it (one process, world 1, in a
subprocess so that the test process keeps no process group or dynamo state)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
import torch, torch.nn as nn
from zerorun.compat import deepspeed

def run(compiled):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": int(sys.argv[1])}})
    before = engine.is_compiled
    if compiled:
        engine.compile(backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    out = {"losses": losses, "before": before, "after": engine.is_compiled}
    engine.destroy()
    return out

print(json.dumps({"eager": run(False), "compiled": run(True)}))
"""


def test_engine_compile_trains_like_eager() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "ZERORUN_DEVICE": "cpu"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    for stage in (2, 3):
        res = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", SCRIPT, str(stage)],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        out = json.loads(res.stdout.strip().splitlines()[-1])
        assert out["eager"]["before"] is False and out["eager"]["after"] is False
        assert out["compiled"]["after"] is True
        assert out["compiled"]["losses"] == out["eager"]["losses"], (stage, out)
