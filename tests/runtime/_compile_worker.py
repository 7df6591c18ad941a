"""One rank of the torch.compile tests: every case of ``CASES`` in one launch. Each case trains
the same model twice from the same weights and data -- uncompiled, then compiled (each block
``block.compile(backend=...)``, or the whole model through ``engine.compile()``) -- and records
both runs' losses, the final parameters and torch._dynamo's counters for the compiled run.
Rank 0 writes {case: result} as JSON.

argv: OUT_JSON [CASE,CASE,...]. Run by test_compile.py through _spawn (also on the GPU machine:
ZERORUN_TEST_DEVICE=cuda, scripts/gpu_checks.sh).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerorun

DIM, STEPS, MICRO = 32, 4, 4

# name: (stage, how, backend, extra zero_optimization keys, dtype)
#   how: "blocks" (block.compile() on each block, FSDP2's recommended pattern) or "engine"
#   (engine.compile(): the whole model, DeepSpeed's API)
CASES: dict[str, tuple[int, str, str, dict, str]] = {
    "z0-blocks-inductor": (0, "blocks", "inductor", {}, "fp32"),
    "z1-blocks-inductor": (1, "blocks", "inductor", {}, "fp32"),
    "z2-blocks-inductor": (2, "blocks", "inductor", {}, "fp32"),
    "z3-blocks-inductor": (3, "blocks", "inductor", {}, "fp32"),
    "z3-blocks-aot_eager": (3, "blocks", "aot_eager", {}, "fp32"),
    "z3-blocks-aot_eager-bf16": (3, "blocks", "aot_eager", {}, "bf16"),
    "z2-offload-blocks-aot_eager": (
        2,
        "blocks",
        "aot_eager",
        {"offload_optimizer": {"device": "cpu"}},
        "fp32",
    ),
    "z3-offload-param-blocks-aot_eager": (
        3,
        "blocks",
        "aot_eager",
        {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
        "fp32",
    ),
    "z2-engine-aot_eager": (2, "engine", "aot_eager", {}, "fp32"),
    "z3-engine-aot_eager": (3, "engine", "aot_eager", {}, "fp32"),
}
N_BLOCKS = 4


class Block(nn.Module):
    """Pre-LayerNorm MLP block with a residual: what a transformer block's MLP half is."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(N_BLOCKS)])
        # A 1-element bias: without slot alignment it shifts every parameter packed after it off
        # 16 bytes, and a compiled block shared by all four read a misaligned view (CUDA error:
        # misaligned address, seen on the H200 with inductor).
        self.out = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return F.mse_loss(self.out(h).squeeze(-1).float(), y.float())


def config(stage: int, extra: dict, dtype: str) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 2000, **extra}
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(MICRO, 6, 8, generator=g).to(device), torch.randn(MICRO, 6, generator=g).to(device)


def train(name: str, compiled: bool, rank: int) -> dict:
    stage, how, backend, extra, dtype = CASES[name]
    torch.manual_seed(7)
    model = Net()
    if compiled and how == "blocks":
        for b in model.blocks:
            b.compile(backend=backend)
    engine, _, _, _ = zerorun.initialize(model=model, config=config(stage, extra, dtype))
    if compiled and how == "engine":
        engine.compile(backend=backend)
    from torch._dynamo.utils import counters

    counters.clear()
    losses = []
    for step in range(STEPS):
        x, y = batch(step, rank, engine.device)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    with torch.no_grad(), zerorun.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    engine.destroy()
    out = {"losses": losses, "params": {n: p.flatten().tolist() for n, p in params.items()}}
    if compiled:
        out["frames_ok"] = int(counters["frames"]["ok"])
        out["unique_graphs"] = int(counters["stats"]["unique_graphs"])
        out["graph_breaks"] = {str(k): int(v) for k, v in counters["graph_break"].items()}
        out["recompiles"] = int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0
        out["is_compiled"] = bool(getattr(engine, "is_compiled", False))
    return out


def main() -> None:
    out_path = Path(sys.argv[1])
    only = set(sys.argv[2].split(",")) if len(sys.argv) > 2 and sys.argv[2] else None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results: dict = {}
    for name in CASES:
        if only and name not in only:
            continue
        t0 = time.monotonic()
        torch._dynamo.reset()  # each case counts its own compiles
        eager = train(name, False, rank)
        compiled = train(name, True, rank)
        gathered = [None] * world
        dist.all_gather_object(gathered, {"eager": eager, "compiled": compiled})
        if rank == 0:
            results[name] = {"ranks": gathered, "seconds": time.monotonic() - t0, "world": world}
    if rank == 0:
        out_path.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
