"""Convergence of the delayed parameter update: exact CPU-offloaded steps vs the delayed update
(``zerorun.delayed_param_update``) with a given warm-up, same model, weights, data and recipe as
the benchmark (benchmarks/workload.py: the README's GPT, AdamW lr 1e-4, bf16, stage 2, CPU
optimizer offload with pinned memory; benchmarks/measure.py's step loop).

    python -m benchmarks.dpu_convergence run --size 125M --steps 300 --warmup-steps 0,40 --out DIR
    python -m benchmarks.dpu_convergence report DIR/dpu_convergence.jsonl [--plot FILE.png]

``run`` trains one configuration per process (a fresh CUDA context and pinned-memory pool each)
and appends one JSON record per run to DIR/dpu_convergence.jsonl: every step's loss, step times,
the config. ``report`` prints, per size, the mean loss of the last 20 steps of each run and its
ratio to the exact run's (the issue's acceptance: within 2 %), and draws the curves side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

LAST = 20  # the acceptance window: mean loss of the last LAST steps
TOLERANCE = 0.02


def _train(
    size: str, steps: int, warmup: int | None, seq_len: int | None, micro: int | None
) -> dict[str, Any]:
    import torch

    from benchmarks.configs import CATALOGUE, zerorun_ds_config
    from benchmarks.measure import loss_curve
    from benchmarks.workload import BETAS, EPS, LR, WEIGHT_DECAY, build_model, gpt_model

    cfg = gpt_model.get_config(size, **({"seq_len": seq_len} if seq_len else {}))
    mb = micro or cfg.micro_batch
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bench = CATALOGUE["zero2_offload_opt" if warmup is None else "zero2_offload_dpu"]
    override = None if warmup is None else {"zerorun": {"delayed_param_update_warmup": warmup}}
    ds = zerorun_ds_config(
        bench, micro_batch=mb, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, override=override
    )
    import zerorun

    model = build_model(cfg, device, 1234)
    engine, _, _, _ = zerorun.initialize(model=model, config=ds)
    del model
    data = gpt_model.SyntheticTokens(cfg, mb, device, seed=1234, rank=0)
    values, times = loss_curve(engine, data, steps, device)
    placement = engine.stage.state.placement
    out = {
        "size": size,
        "steps": steps,
        "mode": "exact" if warmup is None else "delayed",
        "delayed_param_update_warmup": warmup,
        "delayed_steps": getattr(placement, "delayed_steps", 0),
        "losses": values,
        "mean_step_s": statistics.fmean(times[len(times) // 4 :]),
        "seq_len": cfg.seq_len,
        "micro_batch": mb,
        "zerorun_config": ds,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    engine.destroy()
    return out


def _run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / "dpu_convergence.jsonl"
    warmups: list[int | None] = [None] + [int(w) for w in args.warmup_steps.split(",") if w != ""]
    rc = 0
    for w in warmups:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.dpu_convergence",
            "one",
            "--size",
            args.size,
            "--steps",
            str(args.steps),
        ]
        cmd += ["--jsonl", str(jsonl)] + ([] if w is None else ["--warmup", str(w)])
        cmd += ["--seq-len", str(args.seq_len)] if args.seq_len else []
        cmd += ["--micro-batch", str(args.micro_batch)] if args.micro_batch else []
        t0 = time.monotonic()
        try:
            res = subprocess.run(cmd, timeout=args.timeout_s, check=False)
            code = res.returncode
        except subprocess.TimeoutExpired:
            code = 124
        print(
            f"[dpu_convergence] {args.size} warmup={w}: exit {code} in {time.monotonic() - t0:.0f} s",
            flush=True,
        )
        rc = rc or code
    return rc


def _one(args: argparse.Namespace) -> int:
    rec = _train(args.size, args.steps, args.warmup, args.seq_len, args.micro_batch)
    rec["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(args.jsonl, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
    tail = rec["losses"][-LAST:]
    print(
        f"[dpu_convergence] {rec['size']} {rec['mode']} warmup={rec['delayed_param_update_warmup']}: "
        f"final {rec['losses'][-1]:.4f}, mean of last {len(tail)} {statistics.fmean(tail):.4f}, "
        f"{rec['mean_step_s']:.3f} s/step",
        flush=True,
    )
    return 0


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run: the mean loss of the last LAST steps and its ratio to the exact run of the same
    size and step count (the acceptance: |ratio - 1| <= TOLERANCE)."""
    rows = []
    exact = {(r["size"], r["steps"]): r for r in records if r["mode"] == "exact"}
    for r in records:
        tail = r["losses"][-LAST:]
        mean = statistics.fmean(tail)
        ref = exact.get((r["size"], r["steps"]))
        ratio = mean / statistics.fmean(ref["losses"][-LAST:]) if ref else None
        rows.append(
            {
                "size": r["size"],
                "steps": r["steps"],
                "mode": r["mode"],
                "warmup": r["delayed_param_update_warmup"],
                "final_loss": r["losses"][-1],
                "last_mean": mean,
                "ratio_to_exact": ratio,
                "within": None if ratio is None else abs(ratio - 1.0) <= TOLERANCE,
                "mean_step_s": r["mean_step_s"],
            }
        )
    return rows


def _report(args: argparse.Namespace) -> int:
    records = [json.loads(line) for line in Path(args.jsonl).read_text().splitlines() if line.strip()]
    rows = summarize(records)
    print(f"| size | steps | run | final loss | mean of last {LAST} | vs exact | s/step |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        run = "exact" if r["mode"] == "exact" else f"delayed, warm-up {r['warmup']}"
        ratio = (
            ""
            if r["ratio_to_exact"] is None or r["mode"] == "exact"
            else (f"{r['ratio_to_exact']:.4f} {'✓' if r['within'] else '✗'}")
        )
        print(
            f"| {r['size']} | {r['steps']} | {run} | {r['final_loss']:.4f} | {r['last_mean']:.4f} | {ratio} | "
            f"{r['mean_step_s']:.3f} |"
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        sizes = sorted({(r["size"], r["steps"]) for r in records}, key=lambda k: k[1], reverse=True)
        fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4), squeeze=False)
        for ax, (size, steps) in zip(axes[0], sizes, strict=True):
            for r in records:
                if (r["size"], r["steps"]) != (size, steps):
                    continue
                label = (
                    "exact"
                    if r["mode"] == "exact"
                    else f"delayed, warm-up {r['delayed_param_update_warmup']}"
                )
                ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=label, linewidth=1)
            ax.set_title(f"{size} GPT, stage 2 + CPU offload, {steps} steps")
            ax.set_xlabel("step")
            ax.set_ylabel("loss")
            ax.set_yscale("log")
            ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="exact + delayed runs of one size, one process each")
    run.add_argument("--size", default="125M")
    run.add_argument("--steps", type=int, default=300)
    run.add_argument("--warmup-steps", default="0", help="comma list of delayed_param_update_warmup values")
    run.add_argument("--seq-len", type=int, default=None)
    run.add_argument("--micro-batch", type=int, default=None)
    run.add_argument("--timeout-s", type=float, default=300.0, help="per run")
    run.add_argument("--out", default=os.environ.get("OUT", "dpu_out"))
    one = sub.add_parser("one", help=argparse.SUPPRESS)
    one.add_argument("--size", required=True)
    one.add_argument("--steps", type=int, required=True)
    one.add_argument("--warmup", type=int, default=None)
    one.add_argument("--seq-len", type=int, default=None)
    one.add_argument("--micro-batch", type=int, default=None)
    one.add_argument("--jsonl", required=True)
    rep = sub.add_parser("report", help="summary table (+ plot) of a results file")
    rep.add_argument("jsonl")
    rep.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    return {"run": _run, "one": _one, "report": _report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
