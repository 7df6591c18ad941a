"""One rank (world 1) of test_offload_breakdown.py: a small model trained through zerorun with
`wall_clock_breakdown` in several configurations (offload's sub-phases or none), on the device
zerorun picks (CPU here, CUDA on a GPU machine); writes {case: {"timers": the last report's
timers_ms, "line": the printed time line, "profile": the placement's last_profile}}.

argv: OUT_JSON. Run by test_offload_breakdown.py via _spawn.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

import torch
import torch.nn.functional as F
from torch import nn

import zerorun

CASES: dict[str, dict] = {
    "z2-offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "z2-offload-clip": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "z3-param-offload": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
        "stage3_param_persistence_threshold": 0,
    },
    "z2-none": {"stage": 2},
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 256)
        self.down = nn.Linear(256, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.down(F.gelu(self.up(x))), x)


def run(name: str, zero: dict) -> dict:
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0 if name.endswith("clip") else 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"reduce_bucket_size": 3000, "sub_group_size": 2048, **zero},
        "steps_per_print": 3,
        "wall_clock_breakdown": True,
    }
    engine, _, _, _ = zerorun.initialize(model=Net(), config=cfg)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for step in range(6):
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step)).to(engine.device)
            loss = engine(x)
            engine.backward(loss)
            engine.step()
    placement = engine.stage.state.placement
    line = next((x for x in out.getvalue().splitlines() if "time (ms)" in x), "")
    result = {
        "timers": engine.reporter.last_report["timers_ms"],
        "line": line,
        "profile": getattr(placement, "last_profile", {}),
        "device": engine.device.type,
    }
    engine.destroy()
    return result


def main() -> None:
    results = {name: run(name, zero) for name, zero in CASES.items()}
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
