"""``deepspeed.initialize`` with the engine's own checkpoint options, which act in
``Engine.step`` -- not called by ``DeepSpeedEngine.step``: a warning says so, and SIGTERM keeps
its meaning instead of being swallowed by a preemption handler that would never save."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from ._run import PYTHON, env

SCRIPT = r"""
import json, os, signal, sys
import torch
import zerorun.compat
zerorun.compat.activate(announce=False)
import deepspeed

model = torch.nn.Linear(4, 2)
config = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zerorun": {"checkpoint": {"dir": sys.argv[1], "every_n_steps": 1}},
}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
for _ in range(2):
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
print("HANDLER " + json.dumps(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL), flush=True)
os.kill(os.getpid(), signal.SIGTERM)
print("STILL ALIVE", flush=True)
"""


def test_save_on_preemption_and_periodic_saves_are_said_not_acted_on(tmp_path: Path) -> None:
    proc = subprocess.run(
        [PYTHON, "-c", SCRIPT, str(tmp_path / "ckpt")],
        env=env(ZERORUN_SAVE_ON_PREEMPTION="1"), capture_output=True, text=True, timeout=120,
    )
    assert "HANDLER true" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGTERM and "STILL ALIVE" not in proc.stdout, proc.stdout + proc.stderr
    assert (
        "--save_on_preemption and zerorun.checkpoint.every_n_steps (1): not acted on under --deepspeed-compat"
        in proc.stderr
    ), proc.stderr
    assert "saving a checkpoint at the next step boundary" not in proc.stderr
    assert not (tmp_path / "ckpt" / "latest").exists()
