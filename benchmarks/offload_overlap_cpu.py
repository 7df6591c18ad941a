"""On CPU: does the exact offloaded step (CPU optimizer offload, no clipping: the step started in
the backward) return before the CPU has updated every flat buffer, and how much of the CPU work
runs beside the next forward? One process, one rank, a small GPT-like model (embedding, blocks,
tied head), stages 1-3; per step, measured with the placement's own events:

* ``step_s``: how long ``engine.step()`` took;
* ``left_at_return``: flat buffers whose CPU update was not done when it returned;
* ``tail_s``: from the return until the last update was done (set by the worker, read after the
  next forward);
* ``forward_s``: the next forward, which settled the buffers as it used them.

``gradient_clipping`` > 0 (the step waits for the global norm, then for every buffer) is the
comparison row. CPU copies are synchronous and the machine's cores are shared, so the times are
only indicative; the counts are the point.

    python -m benchmarks.offload_overlap_cpu --out benchmarks/results/offload_overlap_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import zerorun

VOCAB, DIM, BLOCKS, SEQ, MICRO = 2048, 512, 8, 8, 1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.head(h[:, :-1]).float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def config(stage: int, clip: float) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 2_200_000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
        "gradient_clipping": clip,
        "zero_optimization": zero,
        "steps_per_print": 10**6,
    }


def run(stage: int, clip: float, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    engine, *_ = zerorun.initialize(model=Net(), config=config(stage, clip))
    pl = engine.stage.state.placement
    g = torch.Generator().manual_seed(1)
    rows = []
    done_at: dict[int, float] = {}
    update = pl._update

    def timed_update(job: Any, *, push: bool, indices: list[int] | None = None, **kw: Any) -> None:
        update(job, push=push, indices=indices, **kw)
        for i in indices or []:
            done_at[i] = time.perf_counter()

    pl._update = timed_update  # the worker's per-buffer update (early steps name their buffer)
    pending: dict[str, Any] | None = None
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        t0 = time.perf_counter()
        loss = engine(ids)
        forward_s = time.perf_counter() - t0
        if pending is not None:  # the previous step's tail, now that the forward settled it
            ends = [done_at.get(i, pending["returned"]) for i in pending["buffers"]]
            pending["row"]["tail_s"] = max(0.0, max(ends, default=pending["returned"]) - pending["returned"])
            pending["row"]["next_forward_s"] = forward_s
        engine.backward(loss)
        done_at.clear()
        t1 = time.perf_counter()
        engine.step()
        returned = time.perf_counter()
        stepped = getattr(pl, "_stepped", {})
        left = [i for i, ev in stepped.items() if isinstance(ev, threading.Event) and not ev.is_set()]
        row = {"step_s": returned - t1, "left_at_return": len(left), "in_flight": len(pl.in_flight())}
        rows.append(row)
        pending = {"row": row, "buffers": list(stepped), "returned": returned}
    engine.destroy()
    measured = [r for r in rows[2:] if "tail_s" in r]  # from the third step: destinations known, warm
    med = {k: statistics.median(r[k] for r in measured) for k in ("step_s", "tail_s", "next_forward_s")}
    return {
        "stage": stage,
        "gradient_clipping": clip,
        "buffers": len(engine.stage.layouts),
        "median": med,
        "left_at_return": [r["left_at_return"] for r in rows],
        "in_flight_at_return": [r["in_flight"] for r in rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out: dict[str, Any] = {
        "what": "exact CPU offload: CPU updates still running when engine.step() returns (offload_overlap_cpu.py)",
        "host": {"cores": len(os.sched_getaffinity(0)), "torch": torch.__version__},
        "model": {"vocab": VOCAB, "dim": DIM, "blocks": BLOCKS, "seq": SEQ, "micro_batch": MICRO},
        "runs": [],
    }
    for stage in (1, 2, 3):
        for clip in (0.0, 1.0):
            r = run(stage, clip, args.steps)
            out["runs"].append(r)
            m = r["median"]
            print(
                f"stage {stage} clip {clip:g}: {r['buffers']} buffers; step() {m['step_s'] * 1e3:.1f} ms, "
                f"left at return {r['left_at_return']}, tail after return {m['tail_s'] * 1e3:.1f} ms, "
                f"next forward {m['next_forward_s'] * 1e3:.1f} ms",
                flush=True,
            )
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
