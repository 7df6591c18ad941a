"""What an asynchronous checkpoint costs the training step (docs/fault-tolerance.md).

For each ZeRO stage asked for, one job of N ranks (started through `zerorun` itself) trains the
README's GPT model with `zerorun.checkpoint: {every_n_steps: 2, async: true}` and measures, per
rank:

- `stall_s`: the time the training thread spends in each asynchronous save (the snapshot into
  host buffers: `AsyncSaver.last_stall_s`); the first save allocates the buffers and is
  reported apart (`first_stall_s`);
- `wait_s`: before each save's snapshot, the time the training thread waited for the previous
  save still writing (`AsyncSaver.last_wait_s`; a save every 2 steps here, so nearly a whole
  write when one write takes longer than 2 steps), and `write_s`, the last background write;
- `snapshot_bytes`: this rank's checkpoint bytes (what the snapshot copies);
- `copy_GBps`: the bandwidth of one copy of that many bytes from the device into pinned host
  memory (on CPU: host to host), measured in the same job (median of 5); `target_s` = 1.1 x
  bytes / bandwidth;
- `sync_save_s`: one synchronous `engine.save_checkpoint` of the same state (barriers around).

The issue's targets: stall <= target_s, and stall <= 10 % of sync_save_s. The summary keeps
the slowest rank's median stall (saves after the first) and target, and the slowest sync save.

    python benchmarks/async_checkpoint.py --device cpu --nproc 2 --n-layer 6 --d-model 512
    python benchmarks/async_checkpoint.py --device cuda --nproc 2 --size 1.3B   # on a GPU machine

With more ranks than GPUs (`--nproc 2` on one GPU) the ranks share the GPUs (`--ranks_per_gpu`,
gloo between ranks of one GPU); each rank's stall is still its own snapshot's, and its copy
bandwidth is measured while the other ranks of its GPU copy too.

Writes `benchmarks/results/async_checkpoint_<device>_<model>.json` (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    import zerorun
    from benchmarks.workload import BETAS, EPS, LR, WEIGHT_DECAY, build_model, gpt_model

    overrides = {k: v for k, v in (("n_layer", args.n_layer), ("d_model", args.d_model), ("seq_len", args.seq_len)) if v}
    cfg = gpt_model.get_config(args.size, **overrides)
    # The shim has set this rank's GPU (LOCAL_RANK // ranks per GPU: ranks may share one).
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    model = build_model(cfg, device, seed=0)
    ckpt = Path(args.dir)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": args.device == "cuda"},
        "steps_per_print": 10**6,
        "zerorun": {"checkpoint": {"dir": str(ckpt / "async"), "every_n_steps": 2, "keep_last": 1, "async": True}},
    }
    engine, *_ = zerorun.initialize(model=model, config=config)
    data = gpt_model.SyntheticTokens(cfg, args.micro_batch, device, rank=engine.global_rank)
    saver = engine.checkpointing.saver
    stalls: list[float] = []
    waits: list[float] = []
    step_s: list[float] = []
    for step in range(args.steps):
        x, y = data.batch(step)
        t0 = time.perf_counter()
        logits = engine(x)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        engine.backward(loss)
        saves = saver.saves
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if saver.saves > saves:
            stalls.append(saver.last_stall_s)
            waits.append(saver.last_wait_s)
        else:
            step_s.append(time.perf_counter() - t0)
    engine.checkpointing.wait()
    nbytes = saver.last_snapshot_bytes

    # The copy the snapshot does, alone: this rank's bytes from the device into pinned memory.
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    copies = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=device.type == "cuda")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        copies.append(time.perf_counter() - t0)
    copy_s = sorted(copies)[len(copies) // 2]  # median: the machine may be shared
    del src, dst

    dist.barrier()
    t0 = time.perf_counter()
    engine.save_checkpoint(str(ckpt / "sync"))
    dist.barrier()
    sync_s = time.perf_counter() - t0

    record = {
        "rank": engine.global_rank,
        "first_stall_s": stalls[0],
        "stall_s": stalls[1:],
        "wait_s": waits[1:],
        "write_s": saver.last_write_s,
        "step_s_median": sorted(step_s)[len(step_s) // 2] if step_s else None,
        "snapshot_bytes": nbytes,
        "copy_GBps": nbytes / copy_s / 1e9,
        "target_s": 1.1 * copy_s,
        "sync_save_s": sync_s,
    }
    Path(f"{args.record}.rank{engine.global_rank}.json").write_text(json.dumps(record))
    engine.destroy()
    dist.destroy_process_group()


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def ranks_per_gpu(device: str, nproc: int, gpus: int) -> int:
    """K ranks per GPU when the job has more ranks than the machine has GPUs (--nproc 2 on one
    GPU: both ranks on GPU 0, gloo between them; the launcher's --ranks_per_gpu)."""
    if device != "cuda" or gpus < 1 or nproc <= gpus:
        return 1
    return -(-nproc // gpus)


def _run_stage(args: argparse.Namespace, stage: int, work: Path) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from zerorun.launch.local import detect_devices  # no torch: the GPUs the launcher would use

    record = work / f"stage{stage}"
    k = ranks_per_gpu(args.device, args.nproc, len(detect_devices().gpus))
    cmd = [
        sys.executable, "-m", "zerorun", "--num_gpus", str(args.nproc), "--device", args.device,
        *(["--ranks_per_gpu", str(k)] if k > 1 else []),
        str(Path(__file__).resolve()), "--worker", "--stage", str(stage), "--size", args.size,
        "--steps", str(args.steps), "--micro-batch", str(args.micro_batch), "--device", args.device,
        "--dir", str(work / f"ckpt{stage}"), "--record", str(record),
    ]
    for flag, value in (("--n-layer", args.n_layer), ("--d-model", args.d_model), ("--seq-len", args.seq_len)):
        if value:
            cmd += [flag, str(value)]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"stage {stage} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    ranks = [json.loads(Path(f"{record}.rank{r}.json").read_text()) for r in range(args.nproc)]
    # A 1.3B model's checkpoint is ~20 GB: free the disk before the next stage's job.
    shutil.rmtree(work / f"ckpt{stage}", ignore_errors=True)
    stall = max(_median(r["stall_s"]) for r in ranks)
    target = max(r["target_s"] for r in ranks)
    sync = max(r["sync_save_s"] for r in ranks)
    return {
        "stage": stage,
        "ranks_per_gpu": k,
        "stall_s_median_max": stall,
        "target_s_max": target,
        "sync_save_s_max": sync,
        "stall_over_target": stall / target,
        "stall_over_sync": stall / sync,
        "wait_s_median_max": max(_median(r["wait_s"]) for r in ranks),
        "write_s_max": max(r["write_s"] for r in ranks),
        "snapshot_bytes_max": max(r["snapshot_bytes"] for r in ranks),
        "copy_GBps_min": min(r["copy_GBps"] for r in ranks),
        "ranks": ranks,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--stages", default="2,3")
    p.add_argument("--size", default="125M")
    p.add_argument("--n-layer", type=int, default=0)
    p.add_argument("--d-model", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=0)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=9, help="optimizer steps; a save after every second one")
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--out", default=None)
    # internal: one rank of a stage's job
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--record", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return
    model = args.size + (f"-L{args.n_layer}" if args.n_layer else "") + (f"-d{args.d_model}" if args.d_model else "")
    work = Path(tempfile.mkdtemp(prefix="zr-async-ckpt-"))
    try:
        stages = [_run_stage(args, int(s), work) for s in args.stages.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "benchmark": "async_checkpoint",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": args.device,
        "nproc": args.nproc,
        "model": model,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip(),
        "stages": stages,
    }
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"async_checkpoint_{args.device}_{model}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for s in stages:
        print(
            f"stage {s['stage']}: stall {s['stall_s_median_max'] * 1e3:.1f} ms (target {s['target_s_max'] * 1e3:.1f} ms: "
            f"{s['stall_over_target']:.2f}x), sync save {s['sync_save_s_max']:.2f} s (stall {100 * s['stall_over_sync']:.1f} %), "
            f"{s['snapshot_bytes_max'] / 2**20:.0f} MiB/rank at {s['copy_GBps_min']:.1f} GB/s; "
            f"waited {s['wait_s_median_max']:.2f} s for the previous save (one write {s['write_s_max']:.2f} s)"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
