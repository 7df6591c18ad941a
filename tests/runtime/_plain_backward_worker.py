"""Rank script: a training loop that calls `loss.backward()` itself (not `engine.backward`) with
gradient accumulation, for every stage and a CPU-offload case, against plain PyTorch by hand.

The engine cannot see such a backward start; the stage's gradient hooks open the reduction and
must still know whether the micro-step ends the accumulation window. Rank 0 prints one JSON
line {case: max abs weight error}."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import zerorun

ACCUM = 2
CASES = {
    "stage0": {"stage": 0},
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage3": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "stage2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))


def _inputs(rank: int, micro: int) -> torch.Tensor:
    return torch.full((1, 4), float(rank * ACCUM + micro + 1))


def run(zero: dict, rank: int, world: int) -> float:
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    # SGD with lr 1: the update is exactly the averaged gradient, so any gradient mistake shows.
    # (The offload case needs Adam-family states on the CPU: eps 1e3 keeps AdamW's first update
    # linear in the gradient, so a missing micro-batch shows there too.)
    optimizer = (
        {"type": "AdamW", "params": {"lr": 1.0, "eps": 1e3, "weight_decay": 0.0}}
        if "offload_optimizer" in zero
        else {"type": "SGD", "params": {"lr": 1.0}}
    )
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": ACCUM,
        "optimizer": optimizer,
        "zero_optimization": zero,
    }
    engine, _, _, _ = zerorun.initialize(model=model, config=cfg)
    for micro in range(ACCUM):
        loss = engine(_inputs(rank, micro)).sum()
        (loss / ACCUM).backward()  # the script scales, as plain PyTorch scripts do
        engine.step()
    # The same step by hand on the global batch.
    ref = _model()
    for r in range(world):
        for micro in range(ACCUM):
            (ref(_inputs(r, micro)).sum() / (ACCUM * world)).backward()
    if "offload_optimizer" in zero:
        expected = torch.optim.AdamW(ref.parameters(), lr=1.0, eps=1e3, weight_decay=0.0)
        expected.step()
        want = [p.detach() for p in ref.parameters()]
    else:
        want = [s - q.grad for s, q in zip(start, ref.parameters(), strict=True)]
    with zerorun.zero.GatheredParameters(list(engine.module.parameters())):
        got = [p.detach().float().clone() for p in engine.module.parameters()]
    return max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))


def shared_across_reentrant_checkpoints(stage: int) -> str:
    """One Linear used in two reentrant checkpoint segments: its gradient hook fires once per
    segment. Stages 0-2 must refuse clearly rather than reduce half a gradient."""
    torch.manual_seed(0)
    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(shared, torch.nn.Linear(4, 1))
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
           "zero_optimization": {"stage": stage}}
    engine, _, _, _ = zerorun.initialize(model=model, config=cfg)
    from torch.utils.checkpoint import checkpoint

    x = torch.ones(1, 4, requires_grad=True)
    h = checkpoint(shared, x, use_reentrant=True)
    h = checkpoint(shared, h, use_reentrant=True)
    try:
        engine.backward(engine.module[1](h).sum())
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    errors = {}
    for name, zero in CASES.items():
        errors[name] = run(zero, rank, world)
    refused = {f"shared_reentrant_stage{s}": shared_across_reentrant_checkpoints(s) for s in (1, 2)}
    if rank == 0:
        print("RESULT " + json.dumps(errors), flush=True)
        print("REFUSED " + json.dumps(refused), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
