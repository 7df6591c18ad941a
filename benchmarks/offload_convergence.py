"""Convergence of the offload modes that keep or change the math, side by side: exact CPU
offload (`zero2_offload_opt`), Twin-Flow partial offload (`zero2_offload_ratio`, exact: its losses
must equal the exact run's up to rounding) and ZenFlow (`zero2_zenflow`, changes the math: issue
17 asks the mean loss of the last 20 steps within 2 % of exact training on the 125M GPT over 300
steps). Same model, weights, data and recipe as the benchmark (benchmarks/workload.py; stage 2,
AdamW, bf16, benchmarks/configs.py's rows); one process per run.

    python -m benchmarks.offload_convergence --size 125M --steps 300            # on a GPU machine
    python -m benchmarks.offload_convergence --size tiny --steps 300 --fp32     # CPU check

Writes `benchmarks/results/offload_convergence_<device>_<size>.json` (or `--out`): per run every
step's loss and the mean step time after a quarter of the steps; the summary: mean loss of the
last 20 steps, its ratio to exact's, the largest per-step loss difference to exact; and, with
matplotlib, `--plot FILE.png`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("zero2_offload_opt", "zero2_offload_ratio", "zero2_zenflow")
LAST = 20
TOLERANCE = 0.02


def train(name: str, size: str, steps: int, fp32: bool, bucket: int | None) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(REPO))
    import zerorun
    from benchmarks.configs import CATALOGUE, zerorun_ds_config
    from benchmarks.measure import loss_curve
    from benchmarks.workload import BETAS, EPS, LR, WEIGHT_DECAY, build_model, gpt_model

    cfg = gpt_model.get_config(size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    override: dict[str, Any] = {"bf16": {"enabled": False}} if fp32 else {}
    if bucket:  # more, smaller flat buffers (a small model's Twin-Flow split needs several)
        override["zero_optimization"] = {"reduce_bucket_size": bucket}
    ds = zerorun_ds_config(
        CATALOGUE[name], micro_batch=cfg.micro_batch, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
        override=override or None,
    )  # fmt: skip
    model = build_model(cfg, device, 1234)
    engine, _, _, _ = zerorun.initialize(model=model, config=ds)
    del model
    data = gpt_model.SyntheticTokens(cfg, cfg.micro_batch, device, seed=1234, rank=0)
    values, times = loss_curve(engine, data, steps, device)
    placement = engine.stage.state.placement
    rec = {
        "config": name,
        "size": size,
        "steps": steps,
        "losses": values,
        "mean_step_s": statistics.fmean(times[len(times) // 4 :]),
        "placement": type(placement).__name__,
        "host_share": getattr(placement, "host_share", None),
        "zenflow_cpu_updates": getattr(placement, "cpu_updates", None),
        "zerorun_config": ds,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    engine.destroy()
    return rec


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    exact = next(r for r in runs if r["config"] == "zero2_offload_opt")
    base = statistics.fmean(exact["losses"][-LAST:])
    out = {}
    for r in runs:
        tail = statistics.fmean(r["losses"][-LAST:])
        out[r["config"]] = {
            "mean_last": tail,
            "ratio_to_exact": tail / base,
            "within_2pct": abs(tail / base - 1) <= TOLERANCE,
            "max_step_diff_to_exact": max(abs(a - b) for a, b in zip(r["losses"], exact["losses"], strict=True)),
            "mean_step_s": r["mean_step_s"],
        }
    return out


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        ax.plot(r["losses"], label=r["config"], linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"offload modes, {runs[0]['size']} GPT, {runs[0]['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="125M")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--fp32", action="store_true", help="fp32 instead of bf16 (CPU: bf16 matmuls are slow)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--reduce-bucket", type=int, default=None, help="reduce_bucket_size override (elements)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(train(args.one, args.size, args.steps, args.fp32, args.reduce_bucket)))
        return 0
    runs = []
    for name in args.configs.split(","):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", name, "--size", args.size, "--steps", str(args.steps)]
        cmd += ["--fp32"] if args.fp32 else []
        cmd += ["--reduce-bucket", str(args.reduce_bucket)] if args.reduce_bucket else []
        t0 = time.monotonic()
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, cwd=REPO, check=False)
        if res.returncode != 0:
            print(res.stderr[-4000:], file=sys.stderr)
            return res.returncode
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(f"[offload_convergence] {name}: {time.monotonic() - t0:.0f} s", flush=True)
    record = {
        "benchmark": "offload_convergence",
        "size": args.size,
        "steps": args.steps,
        "precision": "fp32" if args.fp32 else "bf16",
        "last": LAST,
        "summary": summarize(runs),
        "runs": runs,
        "command": " ".join(["python -m benchmarks.offload_convergence", *sys.argv[1:]]),
    }
    device = "cuda" if runs[0]["device"] != "cpu" else "cpu"
    out = args.out or REPO / "benchmarks" / "results" / f"offload_convergence_{device}_{args.size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    for name, row in record["summary"].items():
        print(
            f"{name:>22}: mean of last {LAST} {row['mean_last']:.4f} ({row['ratio_to_exact']:.4f}x exact), "
            f"max step diff {row['max_step_diff_to_exact']:.2e}, {row['mean_step_s'] * 1e3:.1f} ms/step"
        )
    if args.plot:
        plot(runs, args.plot)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
