"""The engine adapter's accumulation protocols against plain PyTorch, one process (world 1).

    python tests/compat/_engine_worker.py OUT.json

* ``explicit``: accelerate's protocol -- ``set_gradient_accumulation_boundary`` before every
  backward, ``backward(loss, scale_wrt_gas=False)`` on a loss already divided by the window's
  length, ``step()`` only at the boundary; windows of 2, 2 and a short 1 (end of an epoch);
* ``script``: DeepSpeed scripts' protocol -- backward + step for every micro-batch (gas 2);
* ``no_sync``: stage 1, two micro-batches inside ``engine.no_sync()`` then one outside (gas 3);
* what is refused: ``no_sync`` at stage 2, training an engine built without an optimizer,
  an engine attribute DeepSpeed has and the layer does not.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

import zerorun.compat

zerorun.compat.activate()
import deepspeed  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402

from zerorun.errors import RuntimeConfigError  # noqa: E402

torch.manual_seed(0)
DATA = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(5)]


def model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def reference(windows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Plain PyTorch: the mean loss of each window's micro-batches, one AdamW step per window."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for window in windows:
        opt.zero_grad()
        for i in window:
            x, y = DATA[i]
            (nn.functional.mse_loss(m(x), y) / len(window)).backward()
        opt.step()
    return m.state_dict()


def engine(stage: int, gas: int) -> DeepSpeedEngine:
    m = model()
    # Persistence threshold 0: at stage 3 every parameter is partitioned, none replicated.
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    eng, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2), config=config)
    return eng


def max_diff(eng: DeepSpeedEngine, ref: dict[str, torch.Tensor]) -> float:
    if eng.zero_optimization_stage() == 3:
        got = eng._zero3_consolidated_16bit_state_dict()
    else:
        got = {k: v.detach() for k, v in eng.module.state_dict().items()}
    eng.destroy()
    assert all(got[k].shape == ref[k].shape for k in ref)
    return max((got[k] - ref[k]).abs().max().item() for k in ref)


def explicit(stage: int) -> float:
    eng, windows = engine(stage, gas=2), [[0, 1], [2, 3], [4]]
    for window in windows:
        for j, i in enumerate(window):
            eng.set_gradient_accumulation_boundary(j == len(window) - 1)
            x, y = DATA[i]
            eng.backward(nn.functional.mse_loss(eng(x), y) / len(window), scale_wrt_gas=False)
        eng.step()
    assert eng.global_steps == 3 and eng.micro_steps == 5, (eng.global_steps, eng.micro_steps)
    return max_diff(eng, reference(windows))


def script(stage: int) -> float:
    eng = engine(stage, gas=2)
    for x, y in DATA[:4]:
        eng.backward(nn.functional.mse_loss(eng(x), y))
        eng.step()
    assert eng.global_steps == 2
    return max_diff(eng, reference([[0, 1], [2, 3]]))


def no_sync() -> float:
    eng = engine(1, gas=3)
    for k, (x, y) in enumerate(DATA[:3]):
        if k < 2:
            with eng.no_sync():
                eng.backward(nn.functional.mse_loss(eng(x), y))
        else:
            eng.backward(nn.functional.mse_loss(eng(x), y))
        eng.step()
    assert eng.global_steps == 1
    return max_diff(eng, reference([[0, 1, 2]]))


def refusals() -> dict[str, str]:
    out = {}
    eng = engine(2, gas=1)
    try:
        with eng.no_sync():
            pass
    except RuntimeConfigError as exc:
        out["no_sync_stage2"] = str(exc)
    try:
        eng.pipeline_parallelism_world_size  # noqa: B018
    except AttributeError as exc:
        out["missing_attr"] = str(exc)
    out["hasattr"] = str(hasattr(eng, "pipeline_parallelism_world_size"))
    eng.destroy()
    m = model()
    ev, opt, _, _ = deepspeed.initialize(model=m, config={"train_micro_batch_size_per_gpu": 4})
    out["eval_optimizer"] = str(opt)
    x, y = DATA[0]
    try:
        ev.backward(nn.functional.mse_loss(ev(x), y))
    except RuntimeConfigError as exc:
        out["eval_backward"] = str(exc)
    ev.destroy()
    return out


def main() -> None:
    results = {f"explicit_s{s}": explicit(s) for s in (0, 1, 2, 3)}
    results.update({f"script_s{s}": script(s) for s in (1, 3)})
    results["no_sync_s1"] = no_sync()
    results["refusals"] = refusals()
    with open(sys.argv[1], "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main()
