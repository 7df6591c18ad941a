"""Checkpoints in DeepSpeed's layout, written through the layer on real ranks.

    zerorun --deepspeed-compat --num_gpus 2 --device cpu tests/compat/_layout_worker.py OUTDIR CASE [CASE ...]

A case is ``s{stage}-{fp32|bf16|fp16}``: a small model with tied embedding/head weights, a
persistent buffer, a non-persistent one and a frozen parameter trains 3 steps, then
``engine.save_checkpoint(OUTDIR/CASE)`` (zerorun's files + DeepSpeed's) on every rank.
``load CASE`` (world 1 or more) loads ``OUTDIR/CASE`` into a fresh engine at stage 2 and writes
the loaded weights to OUTDIR/CASE-loaded.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import deepspeed
import torch
from torch import nn

OUT = Path(sys.argv[1])
CASES = [a for a in sys.argv[2:] if not a.startswith("--local_rank")]


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 12)
        self.frozen = nn.Linear(12, 12)
        self.frozen.weight.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 12))
        self.head = nn.Linear(12, 32, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.body(self.frozen(self.emb(ids)) * self.scale[0])
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1).float(), ids.flatten())


def config(stage: int, precision: str) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if precision != "fp32":
        cfg[precision] = {"enabled": True} if precision == "bf16" else {"enabled": True, "initial_scale_power": 4}
    return cfg


def train_and_save(case: str) -> None:
    stage, precision = int(case[1]), case.split("-")[1]
    torch.manual_seed(0)
    model = Tiny()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config(stage, precision))
    g = torch.Generator().manual_seed(10 + engine.global_rank)
    for _ in range(3):
        loss = engine(torch.randint(0, 32, (2, 5), generator=g))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(OUT / case))
    engine.destroy()


def load(case: str) -> None:
    torch.manual_seed(1)
    model = Tiny()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config(2, "fp32"))
    engine.load_checkpoint(str(OUT / case))
    if engine.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in engine.module.state_dict().items()}, OUT / f"{case}-loaded.pt")
    engine.destroy()


if CASES[0] == "load":
    load(CASES[1])
else:
    for case in CASES:
        train_and_save(case)
