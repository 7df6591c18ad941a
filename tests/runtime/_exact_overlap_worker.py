"""The exact CPU offload step's overlap with the next forward (deferred write-backs,
HostPlacement.settle; docs/offload.md "The next forward overlaps the CPU step's tail"), proved by
the ORDER of events on CPU ranks, where every copy is synchronous (argv: OUT_JSON).

Per case, two engines train the same steps on the same batches: a plain one, and one whose
placement is instrumented with its own events -- its worker is held until step() (so it then
steps the buffers strictly in the order the next forward needs them) and, at the step under
test, the update of the buffer the forward needs LAST is held until the forward's first module
(the embedding) has started. If step() or the forward's start waited for every buffer's update,
the hold could only end by its timeout, which the worker records. The held engine's losses must
equal the plain one's exactly. Rank 0 writes {case: result}.
"""

from __future__ import annotations

import json
import sys
import threading
import traceback
from typing import Any

import _models
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import zerorun

VOCAB, DIM, BLOCKS, STEPS, HELD_STEP = 40, 24, 4, 4, 2
HOLD_S = 60.0


class Net(nn.Module):
    """Embedding, repeated blocks (optionally recomputed in the backward: activation
    checkpointing runs their forward hooks again), a head tied to the embedding."""

    def __init__(self, recompute: bool = False) -> None:
        super().__init__()
        self.recompute = recompute
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(_models.ResidualBlock(DIM) for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=False) if self.recompute else b(h)
        return F.cross_entropy(self.head(h).float().view(-1, VOCAB), targets.view(-1))


# name -> (stage, how the blocks run: "" plain, "compiled" -- block.compile() with aot_eager: the
# settle hooks run at the compiled blocks' boundaries, eagerly --, "recomputed" -- activation
# checkpointing)
CASES = {
    "z1": (1, ""),
    "z2": (2, ""),
    "z3": (3, ""),
    "z2-compiled": (2, "compiled"),
    "z2-recomputed": (2, "recomputed"),
    "z3-recomputed": (3, "recomputed"),
}


def config(stage: int) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_size": 700,  # about one block per flat buffer at stages 1-2
        "offload_optimizer": {"device": "cpu"},
    }
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=1)
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "bf16": {"enabled": True},
        "gradient_clipping": 0.0,  # the step starts in the backward
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (2, 6), generator=g)
        out.append((ids, torch.roll(ids, 1, dims=1)))
    return out


class Hold:
    """Instruments a placement through its own methods and events (instance attributes)."""

    def __init__(self, engine: Any) -> None:
        self.pl = pl = engine.stage.state.placement
        self.armed = False
        self.hold_last = False
        self.in_step = False
        self.queued = 0  # buffers queued for the CPU since arm()
        self.steps_open = threading.Event()  # set once step() began and every buffer is queued
        self.forward_began = threading.Event()  # set by the first module's forward
        self.timeouts: list[str] = []
        self.seen: dict[str, Any] = {}
        self.last = -1
        early_next, update, step, enqueue = pl._early_next, pl._update, pl.step, pl._enqueue

        def held_early_next(job: Any) -> None:
            if self.armed and not self.steps_open.wait(HOLD_S):
                self.timeouts.append("worker waited for step()")
            early_next(job)

        def held_update(job: Any, *, push: bool, indices: list[int] | None = None, **kw: Any) -> None:
            if self.hold_last and indices == [self.last]:
                self.hold_last = False
                self.seen["last_update_started_after_step"] = self.steps_open.is_set()
                if not self.forward_began.wait(HOLD_S):
                    self.timeouts.append("the last buffer's update waited for the forward")
            update(job, push=push, indices=indices, **kw)

        def counted_enqueue(index: int, job: Any) -> None:
            enqueue(index, job)
            self.queued += 1
            self.maybe_open()

        def opened_step(optimizer: Any) -> None:
            self.in_step = True
            self.maybe_open()
            step(optimizer)

        pl._early_next, pl._update, pl.step, pl._enqueue = held_early_next, held_update, opened_step, counted_enqueue
        engine.module.emb.register_forward_pre_hook(self.first_module)

    def arm(self) -> None:
        """Hold the worker from this step's backward on (the destinations are known)."""
        pl = self.pl
        if not pl.deferrable:  # (stages 1-2 at world > 1 defer nothing: nothing to hold)
            return
        self.last = max(pl.deferrable, key=pl._priority)  # the buffer the next forward uses last
        self.queued = 0
        self.in_step = False
        self.armed = self.hold_last = True

    def maybe_open(self) -> None:
        """The worker may start once step() began and every host buffer is queued (some are
        queued by step() itself): it then picks them strictly by priority (pick_next)."""
        if self.armed and self.in_step and self.queued == len(self.pl._host):
            self.steps_open.set()

    def first_module(self, *_: object) -> None:
        if not self.armed or not self.steps_open.is_set():
            return
        pl = self.pl
        self.seen["in_flight_at_forward"] = sorted(pl.in_flight())
        self.seen["last_stepped_at_forward"] = pl._stepped[self.last].is_set()
        self.seen["last"] = self.last
        self.armed = False  # (later steps run unheld)
        self.forward_began.set()


def run(name: str, rank: int) -> dict[str, Any]:
    stage, blocks = CASES[name]
    data = batches(rank)
    losses: dict[str, list[float]] = {}
    out: dict[str, Any] = {}
    for kind in ("plain", "held"):
        torch.manual_seed(7)
        engine, *_ = zerorun.initialize(model=Net(recompute=blocks == "recomputed"), config=config(stage))
        if blocks == "compiled":
            for block in engine.module.blocks:
                block.compile(backend="aot_eager")
        hold = Hold(engine) if kind == "held" else None
        losses[kind] = []
        returned_pending: list[int] = []
        for step, (ids, tgt) in enumerate(data):
            loss = engine(ids.to(engine.device), tgt.to(engine.device))
            losses[kind].append(loss.item())
            if hold is not None and step == HELD_STEP:
                hold.arm()  # this step's CPU updates are held; the next forward is watched
            engine.backward(loss)
            engine.step()
            returned_pending.append(len(engine.stage.state.placement.in_flight()))
        if hold is not None:
            out.update(hold.seen, timeouts=hold.timeouts, returned_pending=returned_pending)
            out["deferrable"] = sorted(hold.pl.deferrable)
            out["deferred_steps"] = getattr(engine.stage, "deferred_steps", None)
        engine.destroy()
    out["losses"] = losses
    return out


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for name in CASES:
        try:
            results[name] = run(name, rank)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({name: [r[name] for r in gathered] for name in CASES}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
