"""A rank started the way srun starts it (SLURM_* only): initialize, train, agree across ranks."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zerorun

# srun gave only SLURM_*; the shim exported torchrun's variables from them (runtime/world.py),
# the master being the node list's first host.
assert os.environ["RANK"] == os.environ["SLURM_PROCID"] and os.environ["MASTER_ADDR"] == "127.0.0.1"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 2))
config = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 20},
}
engine, *_ = zerorun.initialize(model=model, config=config)
assert dist.get_rank() == int(os.environ["SLURM_PROCID"]) and dist.get_world_size() == 2
for step in range(3):
    g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
    x, y = torch.randn(2, 6, generator=g), torch.randn(2, 2, generator=g)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
with zerorun.zero.GatheredParameters(list(model.parameters())):  # waits for step()'s all-gather
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
everyone = [torch.empty_like(flat) for _ in range(2)]
dist.all_gather(everyone, flat)
assert torch.equal(everyone[0], everyone[1]), "replicas differ"
assert engine.global_steps == 3
if dist.get_rank() == 0:
    Path(sys.argv[1]).write_text("ok")
dist.destroy_process_group()
