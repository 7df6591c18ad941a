"""``deepspeed.initialize`` with accelerate's ``steps_per_print: inf`` ("never print"): no periodic
``[Rank 0] step=...`` lines (dropping the key gave the default 10, a line every 10 steps in every
HF Trainer run); a finite value keeps its meaning."""

from __future__ import annotations

from ._run import run

SCRIPT = r"""
import sys
import torch
import zerorun.compat
zerorun.compat.activate(announce=False)
import deepspeed

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
config = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "steps_per_print": float(sys.argv[1]),
}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
for _ in range(12):
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
print("DONE", flush=True)
"""


def test_inf_means_no_periodic_prints_and_a_finite_value_prints() -> None:
    for value, lines in (("inf", 0), ("1e300", 0), ("5", 2)):
        out = run(["-c", SCRIPT, value], timeout=120).stdout
        assert "DONE" in out, out
        assert out.count("[Rank 0] step=") == lines, (value, out)
