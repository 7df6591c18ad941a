"""DeepSpeed behaviours the peer suites check, on 2 real ranks under ``zerorun --deepspeed-compat``:

    zerorun --deepspeed-compat --num_gpus 2 --device cpu tests/compat/_fixes_worker.py OUTDIR

* ``info``: ``deepspeed.initialize`` logs ``DeepSpeed info: version=...`` on ``deepspeed.utils.logger``;
* ``leaf``: a mixture-of-experts block flagged with ``set_z3_leaf_modules`` trains at stage 3 with
  routing that leaves experts unused on one rank and used on the other, equal to plain PyTorch;
* ``grad_norm``: fp16 with a loss scale that overflows: ``get_global_grad_norm()`` is 0.0 after
  the skipped first step, the norm after an applied step, and that norm again after a skip;
* ``masters``: bf16 at stages 2 and 3: the optimizer exposes fp32 master shards under
  DeepSpeed's names;
* ``init_dtype``: ``deepspeed.zero.Init`` makes parameters in the config's dtype (or ``dtype=``);
  the values are the normal construction's, rounded.
Results: OUTDIR/rank{R}.json.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

import deepspeed
import torch
from deepspeed.utils import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules
from torch import nn

OUT = Path(sys.argv[1])
deepspeed.init_distributed()
RANK = torch.distributed.get_rank()
WORLD = torch.distributed.get_world_size()


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.experts = nn.ModuleList(Expert() for _ in range(4))
        self.used: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = self.gate(x).argmax(-1)
        weight = torch.softmax(self.gate(x), -1).max(-1).values.unsqueeze(-1)
        out = torch.zeros_like(x)
        self.used = sorted({int(e) for e in route})
        for e in self.used:  # only the experts some token is routed to run
            mask = route == e
            out = out.index_put((mask.nonzero().squeeze(-1),), self.experts[e](x[mask]))
        return out * weight


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.moe = MoE()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.inp(x)))


def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(3, 8, generator=g) * 2, torch.randn(3, 2, generator=g)) for _ in range(steps)]


def leaf() -> dict:
    torch.manual_seed(0)
    model = Net()
    flagged = set_z3_leaf_modules(model, [MoE])
    names = [type(m).__name__ for m in get_z3_leaf_modules(model)]
    torch.manual_seed(0)
    ref = Net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": 3,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
    data = [batches(r, 6) for r in range(WORLD)]
    used: list[list[int]] = []
    for step in range(6):
        x, y = data[RANK][step]
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        used.append(engine.module.moe.used)
        ref_opt.zero_grad()
        for r in range(WORLD):
            xr, yr = data[r][step]
            (nn.functional.mse_loss(ref(xr), yr) / WORLD).backward()
        for p in ref.parameters():  # flat ZeRO buffers: an expert no rank ran has a zero gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        ref_opt.step()
    got = engine._zero3_consolidated_16bit_state_dict()
    diff = None
    if RANK == 0:
        want = ref.state_dict()
        diff = max((got[k] - want[k]).abs().max().item() for k in want)
    all_used: list = [None] * WORLD
    torch.distributed.all_gather_object(all_used, used)
    engine.destroy()
    unset = unset_z3_leaf_modules(model, ["MoE"])
    try:
        set_z3_leaf_modules(model, [nn.Conv2d])
        not_found = "no error"
    except ValueError as exc:
        not_found = str(exc)
    return {
        "flagged": len(flagged), "names": names, "diff": diff, "used": all_used,
        "after_unset": len(get_z3_leaf_modules(model)), "unset": len(unset), "not_found": not_found,
    }


def info() -> dict:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep()
    deepspeed.utils.logger.addHandler(handler)
    model = nn.Linear(4, 4)
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=dict(config, optimizer={"type": "AdamW", "params": {"lr": 1e-3}}))
    engine.destroy()
    deepspeed.utils.logger.removeHandler(handler)
    return {"records": records}


def grad_norm() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 1.0,
              "fp16": {"enabled": True, "initial_scale_power": 32, "hysteresis": 1},
              "zero_optimization": {"stage": 2}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)
    before = engine.get_global_grad_norm()
    norms, applied = [], []
    data = batches(RANK, 40)
    for step in range(40):
        x, y = data[step]
        loss = nn.functional.mse_loss(engine(x.half()).float(), y)
        if applied and applied[-1] and len(applied) < 39 and True not in applied[:-1]:
            loss = loss * 1e9  # the step after the first applied one overflows again
        engine.backward(loss)
        engine.step()
        norms.append(engine.get_global_grad_norm())
        applied.append(engine.was_step_applied())
        if applied.count(True) >= 1 and applied[-1] is False and True in applied[:-1]:
            break
    engine.destroy()
    return {"before": before, "norms": norms, "applied": applied}


def masters() -> dict:
    out = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        config = {"train_micro_batch_size_per_gpu": 3, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)
        opt = engine.optimizer
        name = "fp32_partitioned_groups_flat" if stage == 3 else "single_partition_of_fp32_groups"
        tensors = getattr(opt, name)
        same = [any(t is m for m in engine.zerorun_engine.stage.state.masters) for t in tensors]
        out[stage] = {"name": name, "dtypes": sorted({str(t.dtype) for t in tensors}), "count": len(tensors),
                      "same": all(same), "numel": sum(t.numel() for t in tensors),
                      "param_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()})}
        engine.destroy()
    return out


def init_dtype() -> dict:
    def build(**kwargs: object) -> nn.Module:
        torch.manual_seed(0)
        with deepspeed.zero.Init(**kwargs):
            return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2))

    base = {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    out: dict = {}
    cases = {
        "bf16": {"config_dict_or_path": dict(base, bf16={"enabled": True})},
        "fp16": {"config_dict_or_path": dict(base, fp16={"enabled": True})},
        "fp32": {"config_dict_or_path": base},
        "dtype_arg": {"config_dict_or_path": dict(base, bf16={"enabled": True}), "dtype": torch.float16},
    }
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2)).state_dict()
    for name, kwargs in cases.items():
        model = build(**kwargs)
        dtypes = sorted({str(p.dtype) for p in model.parameters()})
        params = list(model.parameters())
        with deepspeed.zero.GatheredParameters(params):
            diff = max(
                (p.detach().float() - plain[k].to(p.dtype).float()).abs().max().item()
                for k, p in model.state_dict(keep_vars=True).items()
            )
        out[name] = {"dtypes": dtypes, "diff_to_rounded_plain": diff}
    # A bf16 zero.Init model trains at stage 3 with bf16.
    config = dict(base, bf16={"enabled": True})
    model = build(config_dict_or_path=config)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
    losses = []
    for x, y in batches(RANK, 3):
        loss = nn.functional.mse_loss(engine(x.bfloat16()).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    out["bf16_training_losses"] = losses
    return out


results = {"info": info(), "leaf": leaf(), "grad_norm": grad_norm(), "masters": masters(), "init_dtype": init_dtype()}
(OUT / f"rank{RANK}.json").write_text(json.dumps(results, default=str))
assert all(math.isfinite(v) for v in results["init_dtype"]["bf16_training_losses"])
