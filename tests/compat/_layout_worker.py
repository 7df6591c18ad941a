"""Checkpoints in DeepSpeed's layout, written through the layer on real ranks.

    zerorun --deepspeed-compat --num_gpus 2 --device cpu tests/compat/_layout_worker.py OUTDIR CASE [CASE ...]

A case is ``s{stage}-{fp32|bf16|fp16}[-2g|-async]``: a small model with tied embedding/head weights, a
persistent buffer, a non-persistent one and a frozen parameter trains 3 steps, then
``engine.save_checkpoint(OUTDIR/CASE)`` (zerorun's files + DeepSpeed's) on every rank; ``-2g``:
two optimizer param groups (weights with decay, biases without and another lr); ``-async``: the
save at step 3 is the engine's own asynchronous one (zerorun.checkpoint every_n_steps + async).
``load CASE`` (world 1 or more) loads ``OUTDIR/CASE`` into a fresh engine at stage 2 and writes
the loaded weights to OUTDIR/CASE-loaded.pt. ``crash CASE`` saves after 3 steps, then trains 3
more and saves again with rank 0 SIGKILLed just before that save's commit
(ZERORUN_CHECKPOINT_CRASH=0:before_commit).
"""

from __future__ import annotations

import os
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


def config(stage: int, precision: str, case: str = "") -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if precision != "fp32":
        cfg[precision] = {"enabled": True} if precision == "bf16" else {"enabled": True, "initial_scale_power": 4}
    if case.endswith("-async"):  # the engine's own asynchronous save at step 3, no explicit one
        cfg["zerorun"] = {"checkpoint": {"dir": str(OUT / case), "every_n_steps": 3, "async": True}}
    return cfg


def parameters(model: nn.Module, case: str) -> list:
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not case.endswith("-2g"):
        return [p for _, p in trained]
    return [{"params": [p for n, p in trained if not n.endswith("bias")], "weight_decay": 0.1},
            {"params": [p for n, p in trained if n.endswith("bias")], "weight_decay": 0.0, "lr": 5e-3}]


def train_and_save(case: str, crash: bool = False) -> None:
    stage, precision = int(case[1]), case.split("-")[1]
    torch.manual_seed(0)
    model = Tiny()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameters(model, case),
                                      config=config(stage, precision, case))
    g = torch.Generator().manual_seed(10 + engine.global_rank)
    for attempt in range(2 if crash else 1):
        for _ in range(3):
            loss = engine(torch.randint(0, 32, (2, 5), generator=g))
            engine.backward(loss)
            engine.step()
        if attempt == 1:
            os.environ["ZERORUN_CHECKPOINT_CRASH"] = "0:before_commit"
        if not case.endswith("-async"):
            engine.save_checkpoint(str(OUT / case))
    if engine.zerorun_engine.checkpointing is not None:
        engine.zerorun_engine.checkpointing.wait()  # the asynchronous save committed
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
elif CASES[0] == "crash":
    train_and_save(CASES[1], crash=True)
else:
    for case in CASES:
        train_and_save(case)
