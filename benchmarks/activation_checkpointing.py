"""Activation checkpointing on one GPU: no checkpointing vs block checkpointing with
`zerorun.checkpointing.checkpoint`, activations kept on the GPU (`plain`) or in pinned host
memory (`cpu`: `activation_checkpointing.cpu_checkpointing`). The issue's benchmark: the README's
1.3B GPT (examples/gpt_model.py), batch 8 x 2,048, bf16, ZeRO stage 2, AdamW (benchmarks/workload.py).

    python -m benchmarks.activation_checkpointing --size 1.3B --out benchmarks/results/activation_checkpointing.json
    python -m benchmarks.activation_checkpointing --size 1.3B --find-max 8,12,16,24,32,48,64 --out ...

Each (mode, micro batch) runs in a process of its own (a fresh CUDA context; an OOM ends only
that process) and reports tokens/s over the timed steps (after warm-up; the device is
synchronised around them), the peak of `torch.cuda.max_memory_allocated`, and the GPU memory
held between forward and backward of the last timed step (`after_forward`: parameters, states
and the kept activations). `--find-max` also records, per mode, the largest micro batch of the
list that trains without running out of memory. The JSON file holds every record.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODES = ("none", "plain", "cpu")


def _train(size: str, mode: str, micro: int, steps: int, warmup: int) -> dict[str, Any]:
    import torch

    import zerorun
    import zerorun.checkpointing as checkpointing
    from benchmarks.workload import BETAS, EPS, LR, WEIGHT_DECAY, build_model, gpt_model

    cfg = gpt_model.get_config(size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(cfg, device, 1234)
    if mode != "none":
        blocks = list(model.blocks)

        def run_blocks(x: torch.Tensor) -> torch.Tensor:
            for block in blocks:
                x = checkpointing.checkpoint(block, x)
            return x

        model.blocks = torch.nn.ModuleList()  # the loop in GPT.forward now sees no blocks ...
        model.ckpt_blocks = torch.nn.ModuleList(blocks)
        model.ln_f.register_forward_pre_hook(lambda _m, args: (run_blocks(args[0]),))  # ... they run here
    ds = {
        "train_micro_batch_size_per_gpu": micro,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY}},
        "activation_checkpointing": {"cpu_checkpointing": mode == "cpu"},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = zerorun.initialize(model=model, config=ds)
    del model
    data = gpt_model.SyntheticTokens(cfg, micro, device, seed=1234, rank=0)
    cuda = device.type == "cuda"
    after_forward = 0
    t0 = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        x, y = data.batch(i)
        loss = engine(x, y)
        if cuda and i == warmup + steps - 1:
            after_forward = torch.cuda.memory_allocated(device)
        engine.backward(loss)
        engine.step()
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    rec = {
        "size": size,
        "mode": mode,
        "micro_batch": micro,
        "seq_len": cfg.seq_len,
        "steps": steps,
        "tokens_per_sec": steps * micro * cfg.seq_len / elapsed,
        "peak_allocated": torch.cuda.max_memory_allocated(device) if cuda else None,
        "after_forward": after_forward if cuda else None,
        "final_loss": float(loss.detach().float()),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
    }
    engine.destroy()
    return rec


def _spawn(args: argparse.Namespace, mode: str, micro: int, steps: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.activation_checkpointing", "one", "--size", args.size, "--mode", mode]
    cmd += ["--micro-batch", str(micro), "--steps", str(steps), "--warmup", str(args.warmup)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "micro_batch": micro, "status": "timeout"}
    for line in res.stdout.splitlines():
        if line.startswith("RECORD "):
            return {**json.loads(line[7:]), "status": "ok"}
    oom = "out of memory" in (res.stderr + res.stdout).lower()
    return {"mode": mode, "micro_batch": micro, "status": "oom" if oom else f"exit {res.returncode}", "stderr": res.stderr[-2000:]}


def _run(args: argparse.Namespace) -> int:
    records = []
    for mode in MODES:
        rec = _spawn(args, mode, args.micro_batch, args.steps)
        records.append(rec)
        print(f"[activation_checkpointing] {mode} mb={args.micro_batch}: {rec.get('status')} "
              f"{rec.get('tokens_per_sec', 0):.0f} tok/s, peak {rec.get('peak_allocated')}", flush=True)
    largest: dict[str, int | None] = {}
    if args.find_max:
        for mode in MODES:
            largest[mode] = None
            for mb in sorted(int(m) for m in args.find_max.split(",")):
                rec = _spawn(args, mode, mb, 2)
                records.append({**rec, "probe": True})
                if rec.get("status") != "ok":
                    break
                largest[mode] = mb
            print(f"[activation_checkpointing] {mode}: largest micro batch {largest[mode]}", flush=True)
    out = {"size": args.size, "micro_batch": args.micro_batch, "records": records, "largest_micro_batch": largest,
           "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0 if all(r.get("status") == "ok" for r in records if not r.get("probe")) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd")
    one = sub.add_parser("one", help="one (mode, micro batch) in this process")
    for q in (p, one):
        q.add_argument("--size", default="1.3B")
        q.add_argument("--micro-batch", type=int, default=8)
        q.add_argument("--steps", type=int, default=10)
        q.add_argument("--warmup", type=int, default=3)
    one.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--find-max", default="", help="comma-separated micro batches to probe per mode")
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--out", default="benchmarks/results/activation_checkpointing.json")
    args = p.parse_args(argv)
    if args.cmd == "one":
        rec = _train(args.size, args.mode, args.micro_batch, args.steps, args.warmup)
        print("RECORD " + json.dumps(rec), flush=True)
        return 0
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
