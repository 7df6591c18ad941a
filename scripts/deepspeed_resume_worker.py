"""One side of scripts/deepspeed_resume_check.py: the same training under zerorun's layer or under
real DeepSpeed (this file only imports ``deepspeed``; which one that is depends on how it runs).

    zerorun --deepspeed-compat --num_gpus 2 --device cpu scripts/deepspeed_resume_worker.py OUT CASE save
    RANK=r WORLD_SIZE=2 ... python scripts/deepspeed_resume_worker.py OUT CASE resume|fresh|dssave   (real DeepSpeed)

CASE ``s{stage}-{fp32|bf16}``: a small MLP with two optimizer param groups (weights with decay,
biases without and another lr), AdamW. ``save``: 3 steps, ``engine.save_checkpoint(OUT/CASE)``,
then step 4; ``resume``: a fresh engine, ``engine.load_checkpoint(OUT/CASE)`` (optimizer states
too), then step 4; ``fresh``: the same load with ``load_optimizer_states=False`` (the control: what
step 4 gives without the moments). Every mode writes rank 0's full parameters after step 4 to
``OUT/CASE-{mode}.pt``. ``dssave`` (real DeepSpeed): 3 steps, then DeepSpeed's own checkpoint in
``OUT/CASE-ds`` (for zerorun to read).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import deepspeed
import torch
from torch import nn

OUT, CASE, MODE = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
STAGE, PRECISION = int(CASE[1]), CASE.split("-")[1]


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 5, generator=g)


def main() -> None:
    if MODE != "save":  # real DeepSpeed on CPU ranks: gloo
        deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 5))
    groups = [{"params": [model[0].weight, model[2].weight], "weight_decay": 0.1},
              {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0, "lr": 5e-3}]
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": STAGE, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": PRECISION == "bf16"},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    rank = engine.global_rank
    dtype = torch.bfloat16 if PRECISION == "bf16" else torch.float32

    def train(step: int) -> None:
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        engine.step()

    if MODE in ("save", "dssave"):
        for step in (1, 2, 3):
            train(step)
        engine.save_checkpoint(str(OUT / (CASE if MODE == "save" else f"{CASE}-ds")))
    else:
        engine.load_checkpoint(str(OUT / CASE), load_optimizer_states=MODE == "resume", load_lr_scheduler_states=False)
    train(4)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        full = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    if rank == 0:
        torch.save(full, OUT / f"{CASE}-{MODE}.pt")


main()
if MODE != "save":
    os._exit(0)  # real DeepSpeed's CPU teardown is not needed for the result
