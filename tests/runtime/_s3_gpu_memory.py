"""Stage-3 memory at rest per rank against ZeRO's 16Ψ/N, measured by the CUDA allocator.

    zerorun --num_gpus 4 --ranks_per_gpu 4 tests/runtime/_s3_gpu_memory.py --size 350M

(scripts/gpu_checks.sh runs it.) The model is built under ``zerorun.zero.Init``, trained a few
steps, and ``torch.cuda.memory_allocated()`` is read at rest (after ``step``: every group
released) and after the last backward (gradient slices alive). Expected per rank, bf16 +
AdamW, fp32 gradient slices:

    after backward: 16 * Ψ / N   (fp32 master = at-rest shard 4, gradient slice 4, Adam 8)
    at rest:        12 * Ψ / N   (gradient slices are dropped after the optimizer step)
  + 2 * Ψ_persistent              (persistent params are replicated in bf16)
  + padding (< N * 64 elements per flat buffer) and the allocator's rounding

Rank 0 prints one JSON line (and writes it to $OUT/s3_memory_w{N}.json when OUT is set).
On CPU (no CUDA) it falls back to the runtime's own ledger, which only checks it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import zerorun  # noqa: E402
from examples.gpt_model import GPT, SyntheticTokens, get_config  # noqa: E402


def allocated() -> int:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return int(torch.cuda.memory_allocated())
    return -1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="125M")
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    cfg = get_config(args.size, seq_len=args.seq_len)
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0},
        "steps_per_print": 1000,
    }
    base = allocated()
    with zerorun.zero.Init(config=ds):
        model = GPT(cfg)
    after_init_ctx = allocated() - base
    engine, *_ = zerorun.initialize(model=model, config=ds)
    after_initialize = allocated() - base
    data = SyntheticTokens(cfg, 2, engine.device, seed=7, rank=engine.global_rank)
    losses = []
    after_backward = -1
    for step in range(args.steps):
        x, y = data.batch(step)
        loss = engine(x, y)
        engine.backward(loss)
        if step == args.steps - 1:
            after_backward = allocated() - base  # gathered groups are released by now
        engine.step()
        losses.append(float(loss))
    at_rest = allocated() - base
    peak = int(torch.cuda.max_memory_allocated()) - base if torch.cuda.is_available() else -1
    st = engine.stage
    world = engine.world_size
    persistent = sum(layout.numel for g in st.groups if g.persistent for layout in g.layouts)
    partitioned = sum(layout.numel for g in st.groups if not g.persistent for layout in g.layouts)
    padding = sum(layout.padded_numel - layout.numel for layout in st.layouts)
    psi = partitioned + persistent
    expected_rest = 12 * psi / world + 2 * persistent
    expected_backward = 16 * psi / world + 2 * persistent
    result = {
        "size": args.size,
        "world": world,
        "psi": psi,
        "psi_persistent": persistent,
        "after_zero_init_bytes": after_init_ctx,
        "after_initialize_bytes": after_initialize,
        "at_rest_bytes": at_rest,
        "expected_at_rest_12psi_over_n_bytes": expected_rest,
        "ratio_at_rest": at_rest / expected_rest if at_rest > 0 else None,
        "after_backward_bytes": after_backward,
        "expected_after_backward_16psi_over_n_bytes": expected_backward,
        "ratio_after_backward": after_backward / expected_backward if after_backward > 0 else None,
        "padding_bytes_max": 16 * padding / world,
        "peak_bytes": peak,
        "ledger": engine.memory_summary(),
        "losses": losses,
        "device": str(engine.device),
    }
    if engine.global_rank == 0:
        line = json.dumps(result)
        print(line)
        out = os.environ.get("OUT")
        if out:
            Path(out, f"s3_memory_w{world}.json").write_text(line + "\n")


if __name__ == "__main__":
    main()
