"""Stage 3 at one rank, CPU optimizer offload, no clipping, a persistent group (the norms and
biases): its write-back is deferred like every group's (Stage3._persistent) and settled before
anything reads it. Proved with the worker HELD before it updates the persistent buffer at one
step: step() returns anyway, and a reader -- state_dict(), GatheredParameters, the next forward --
blocks until the held update landed and then sees it (argv: OUT_JSON; rank 0 writes the result).

Two engines train the same batches: a plain one and the held one; everything read must be equal.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from typing import Any

import _models
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerorun

VOCAB, DIM, BLOCKS, STEPS, HELD_STEP = 40, 24, 3, 4, 2
RELEASE_AFTER_S = 0.3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(_models.ResidualBlock(DIM) for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.head(self.norm(h)).float().view(-1, VOCAB), targets.view(-1))


CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "bf16": {"enabled": True},
    "gradient_clipping": 0.0,  # the step starts in the backward
    # DIM-element norms/biases are persistent, the DIM*DIM matrices and the embedding are not
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 100},
    "steps_per_print": 1000,
}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (2, 6), generator=g)
        out.append((ids, torch.roll(ids, 1, dims=1)))
    return out


def snapshot(sd: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    return {k: v.detach().float().cpu().reshape(-1).tolist() for k, v in sd.items()}


def run(held: bool) -> dict[str, Any]:
    torch.manual_seed(7)
    engine, *_ = zerorun.initialize(model=Net(), config=CONFIG)
    stage, pl = engine.stage, engine.stage.state.placement
    persistent = [layout.index for g in stage.groups if g.persistent for layout in g.layouts]
    out: dict[str, Any] = {"persistent": persistent, "losses": [], "returned_in_flight": []}
    hold = threading.Event()
    arm = {"on": False}
    early_next = pl._early_next

    def held_early_next(job: Any) -> None:
        # The worker picks the queued buffer of best priority itself: peek at what it will take.
        with pl._sched:
            ready = [e for e in pl._queue if pl._arrived(e[2])]
            nxt = min(ready) if ready else min(pl._queue, key=lambda e: e[1])
        if arm["on"] and nxt[2] in persistent:
            arm["on"] = False
            hold.wait(20)  # (old code: step() waited for this update -- released by timeout only)
        early_next(job)

    if held:
        pl._early_next = held_early_next
    for step, (ids, tgt) in enumerate(batches()):
        loss = engine(ids.to(engine.device), tgt.to(engine.device))
        out["losses"].append(loss.item())
        arm["on"] = held and step == HELD_STEP
        engine.backward(loss)
        engine.step()
        out["returned_in_flight"].append(sorted(pl.in_flight()))
        if step == HELD_STEP:
            if held:
                out["persistent_stepped_at_return"] = all(pl._stepped[i].is_set() for i in persistent)
                threading.Timer(RELEASE_AFTER_S, hold.set).start()
            t0 = time.perf_counter()
            out["state_dict"] = snapshot(engine.module.state_dict())  # a reader: settles everything
            out["reader_waited_s"] = time.perf_counter() - t0
            with zerorun.zero.GatheredParameters([engine.module.norm.weight]):
                out["gathered_norm"] = engine.module.norm.weight.detach().float().reshape(-1).tolist()
    out["profile"] = dict(pl.last_profile)
    engine.destroy()
    return out


def main() -> None:
    dist.init_process_group("gloo")
    try:
        result = {"plain": run(False), "held": run(True)}
    except Exception:
        result = {"error": traceback.format_exc()}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
