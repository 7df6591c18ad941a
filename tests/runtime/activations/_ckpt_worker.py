"""zerorun.checkpointing.checkpoint under ZeRO stages 0-3 on real ranks, against plain PyTorch
with torch.utils.checkpoint on the global batch. Rank 0 writes {case: "ok" | failure} as JSON.

Cases: stage x mode, mode = plain (activations on the device), cpu (cpu_checkpointing from the
config; on a CPU device host memory is the device), partition (partition_activations across an
mpu whose model-parallel group is the whole world, with the identical micro-batch on every rank,
as tensor parallelism replicates activations; each rank must hold half of every checkpointed input).
With ZERORUN_TEST_DEVICE=cuda (scripts/gpu_checks.sh) the engine runs on the GPU: cpu mode then
really keeps the checkpointed inputs in pinned host memory (asserted) and copies them back on
the side stream; the reference stays on the CPU.
"""

from __future__ import annotations

import json
import math
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import zerorun
import zerorun.checkpointing as checkpointing

STEPS = 3
MICRO = 4


class Net(nn.Module):
    def __init__(self, ckpt) -> None:  # noqa: ANN001
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(6, 10)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(10, 10), nn.GELU(), nn.Linear(10, 10)) for _ in range(4))
        self.head = nn.Linear(10, 3)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + self.ckpt(block, h)
        return self.head(h)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(MICRO, 6, generator=g), torch.randn(MICRO, 3, generator=g)


class WorldMpu:
    """Megatron's mpu surface, with the whole world as the model-parallel group."""

    def get_model_parallel_group(self):  # noqa: ANN201
        return dist.group.WORLD

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank()

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size()


def stashes(loss: torch.Tensor) -> list:
    """The checkpoint nodes' stashes in the autograd graph of `loss`."""
    seen, out, todo = set(), [], [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(node, "stash", None) is not None:
            out.append(node.stash)
        todo.extend(n for n, _ in node.next_functions)
    return out


def run_case(stage: int, mode: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    data_rank = (lambda r: 0) if mode == "partition" else (lambda r: r)  # noqa: E731
    checkpointing.reset()
    if mode == "partition":
        checkpointing.configure(WorldMpu(), partition_activations=True)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "activation_checkpointing": {"cpu_checkpointing": mode == "cpu"},
    }
    model = Net(checkpointing.checkpoint)
    engine, *_ = zerorun.initialize(model=model, config=config)
    dev = engine.device
    for step in range(STEPS):
        x, y = batch(step, data_rank(rank))
        loss = nn.functional.mse_loss(engine(x.to(dev)), y.to(dev))
        if step == 0 and mode == "cpu" and dev.type == "cuda":
            found = stashes(loss)
            assert len(found) == 4, len(found)
            for st in found:
                for h in (h for h in st._items if hasattr(h, "data")):
                    assert h.data.device.type == "cpu" and h.data.is_pinned(), (h.data.device, h.data.is_pinned())
        if step == 0 and mode == "partition":
            found = stashes(loss)
            assert len(found) == 4, len(found)
            for st in found:
                held = [h for h in st._items if hasattr(h, "data")]
                assert [h.data.numel() for h in held] == [math.ceil(MICRO * 10 / world)], [h.data.numel() for h in held]
        engine.backward(loss)
        engine.step()
    got = {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}  # full tensors at stage 3 too
    engine.destroy()

    ref = Net(lambda f, h: torch_checkpoint(f, h, use_reentrant=False))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        xs, ys = zip(*(batch(step, data_rank(r)) for r in range(world)), strict=True)
        nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    for name, want in ref.state_dict().items():
        tol = 1e-5 if dev.type == "cpu" else 1e-4  # GPU kernels sum in another order
        assert torch.allclose(got[name], want, rtol=tol, atol=tol / 10), (name, (got[name] - want).abs().max().item())


def main() -> None:
    dist.init_process_group("gloo")
    results = {}
    for stage in (0, 1, 2, 3):
        for mode in ("plain", "cpu", "partition"):
            try:
                run_case(stage, mode)
                results[f"stage{stage}-{mode}"] = "ok"
            except Exception:  # noqa: BLE001
                results[f"stage{stage}-{mode}"] = "FAIL: " + traceback.format_exc()[-3000:]
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
