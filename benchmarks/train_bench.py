"""Train-step benchmark of zerorun against plain PyTorch, DDP and FSDP2 on the repo's GPT model.

Run from the repository root:

    python benchmarks/train_bench.py --size 1.3B --configs quick            # 1 GPU
    python benchmarks/train_bench.py --size 1.3B --configs full --nproc 8   # 8 GPUs (torchrun)
    python benchmarks/train_bench.py --mode memory --size 1.3B --nproc 4 --ranks-per-gpu 4
    python benchmarks/train_bench.py --size tiny --device cpu --configs plain,fsdp2   # smoke test

Each configuration runs in a process (group) of its own, under a deadline; its JSON record is
written under --out as soon as it finishes. The plain baseline runs first and again last
(noise band). At the end a short table is printed; `benchmarks/report.py` renders RESULTS.md.

Under a launcher (`zerorun --num_gpus N benchmarks/train_bench.py --configs zero2`, or
torchrun), the script is itself one configuration's ranks and writes its record directly.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from benchmarks import configs as catalogue  # noqa: E402
from benchmarks.orchestrate import LaunchSpec, finish_record, launch_command, run_launch  # noqa: E402
from benchmarks.report import console_table  # noqa: E402
from benchmarks.results import write_record  # noqa: E402

_WORKER_FIELDS = (
    "size",
    "mode",
    "seq_len",
    "micro_batch",
    "warmup",
    "steps",
    "seed",
    "device",
    "ranks_per_gpu",
    "pg_timeout_s",
    "peak_tflops",
    "zerorun_override",
    "profile",
    "profile_dir",
)


# A configuration is not started with less time than this left in --budget-s.
_MIN_DEADLINE_S = 30.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", default="1.3B", help="model size: tiny, 125M, 350M, 1.3B (reference), 2.7B, 7B")
    p.add_argument(
        "--configs",
        default="quick",
        help="presets (quick, full, zerorun, peers, memory) and/or names, comma-separated",
    )
    p.add_argument("--mode", choices=("throughput", "memory"), default="throughput")
    p.add_argument("--nproc", type=int, default=1, help="ranks per configuration (plain always runs on 1)")
    p.add_argument(
        "--ranks-per-gpu",
        "--ranks_per_gpu",
        dest="ranks_per_gpu",
        type=int,
        default=None,
        help="ranks sharing one GPU (gloo); memory mode defaults to --nproc",
    )
    p.add_argument(
        "--launcher",
        choices=("auto", "none", "torchrun", "zerorun"),
        default="auto",
        help="how to start several ranks (auto: torchrun when --nproc > 1)",
    )
    p.add_argument("--seq-len", type=int, default=None, help="override the size's sequence length")
    p.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="sequences per GPU per step (default: the size's; 1 in memory mode)",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps (>= 10 for a reported median)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak dense bf16 TFLOP/s per GPU for MFU (default: known GPUs, H200 989)",
    )
    p.add_argument("--timeout-s", type=float, default=600.0, help="deadline per configuration")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock budget of the whole run; what does not fit is recorded as not_run",
    )
    p.add_argument("--pg-timeout-s", type=float, default=300.0, help="process-group timeout inside the ranks")
    p.add_argument("--zerorun-override", default=None, help="JSON merged into every zerorun config")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        help="N extra steps under torch.profiler after the timed ones; top ops go in the record",
    )
    p.add_argument("--profile-dir", default=None, help="also write rank 0's Chrome trace here (large files)")
    p.add_argument(
        "--no-baseline-repeat", action="store_true", help="run plain once instead of first and last"
    )
    p.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results", help="directory for the JSON records"
    )
    p.add_argument(
        "--bundle", type=Path, default=None, help="also append every record to this JSON-lines file"
    )
    p.add_argument("--run-id", default=None, help="default: UTC time + size + world size")
    p.add_argument("--quiet", action="store_true", help="do not echo the ranks' output")
    # Internal: one configuration's ranks, started by the orchestrator.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--repeat", type=int, default=1, help=argparse.SUPPRESS)
    return p


def _run_id(a: argparse.Namespace, minute_only: bool = False) -> str:
    if a.run_id:
        return str(a.run_id)
    stamp = time.strftime("%Y%m%dT%H%MZ" if minute_only else "%Y%m%dT%H%M%SZ", time.gmtime())
    tag = "mem" if a.mode == "memory" else "thr"
    return f"{stamp}-{a.size}-w{a.nproc if not minute_only else os.environ.get('WORLD_SIZE', '1')}-{tag}"


def _worker(a: argparse.Namespace, result_file: str, run_id: str) -> int:
    from benchmarks.worker import WorkerArgs, run_worker

    kw = {f: getattr(a, f) for f in _WORKER_FIELDS}
    return run_worker(
        WorkerArgs(config=a.config, result_file=result_file, run_id=run_id, repeat=a.repeat, **kw)
    )


def _git_commit() -> str | None:
    """The commit measured: ZERORUN_BENCH_COMMIT when the tree is a copy (a `git archive` carried to
    the GPU machine), else the repository's HEAD -- only when ROOT is the top of that repository, so
    an archive unpacked inside another checkout does not report the outer checkout's HEAD."""
    if os.environ.get("ZERORUN_BENCH_COMMIT"):
        return os.environ["ZERORUN_BENCH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--show-toplevel", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != ROOT.resolve():
        return None
    return lines[1]


def _orchestrate(a: argparse.Namespace) -> int:
    if a.mode == "memory" and a.ranks_per_gpu is None:
        a.ranks_per_gpu = a.nproc  # all ranks share one GPU
    chosen, notes = catalogue.select(a.configs, a.nproc)
    for n in notes:
        print(f"[bench] {n}", flush=True)
    if a.mode == "memory":
        chosen = [c for c in chosen if c.family == "zerorun"]
    plan = catalogue.run_plan(chosen, repeat_baseline=not a.no_baseline_repeat)
    if not plan:
        print("[bench] nothing to run", file=sys.stderr)
        return 2
    run_id = _run_id(a)
    launcher = a.launcher if a.launcher != "auto" else ("torchrun" if a.nproc > 1 else "none")
    commit = _git_commit()
    print(
        f"[bench] run {run_id}: {', '.join(c.name + ('#2' if r > 1 else '') for c, r in plan)} -> {a.out}",
        flush=True,
    )
    records: list[dict[str, Any]] = []
    script = str(Path(__file__).resolve())
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zr-bench-") as tmp:
        for bench, repeat in plan:
            nproc = 1 if bench.single_process else a.nproc
            spec = LaunchSpec(launcher if nproc > 1 else "none", nproc, a.ranks_per_gpu or 1, a.device)
            base = {
                "run_id": run_id,
                "config": bench.name,
                "family": bench.family,
                "description": bench.description,
                "mode": a.mode,
                "repeat": repeat,
                "size": a.size,
                "world_size": spec.nproc,
            }
            deadline = a.timeout_s
            if a.budget_s is not None:
                deadline = min(deadline, a.budget_s - (time.monotonic() - start))
                if deadline < _MIN_DEADLINE_S:
                    record = {
                        **base,
                        "status": "not_run",
                        "error": f"the run's --budget-s {a.budget_s:.0f} s was used up",
                    }
                    write_record(a.out, {**record, "git_commit": commit}, a.bundle)
                    records.append(record)
                    print(f"[bench] --- {bench.name}: not run, budget used up", flush=True)
                    continue
            result_file = Path(tmp) / f"{bench.name}-{repeat}.json"
            wargs = [
                "--worker",
                "--config",
                bench.name,
                "--result-file",
                str(result_file),
                "--run-id",
                run_id,
                "--repeat",
                str(repeat),
            ]
            for f in _WORKER_FIELDS:
                v = getattr(a, f)
                if v is not None:
                    wargs += [f"--{f.replace('_', '-')}", str(v)]
            argv, env = launch_command(spec, script, wargs)
            label = bench.name + (f"#{repeat}" if repeat > 1 else "")
            print(
                f"[bench] >>> {label}: {' '.join(argv[:6])} ... ({spec.nproc} rank(s), deadline {deadline:.0f} s)",
                flush=True,
            )
            outcome = run_launch(argv, env, deadline, prefix=f"[{label}]", echo=not a.quiet)
            record = finish_record(result_file, outcome, base, deadline)
            record.update(git_commit=commit, launcher=spec.launcher, launch_argv=argv)
            path = write_record(a.out, record, a.bundle)
            records.append(record)
            summary = record.get("error") or (
                f"{record.get('tokens_per_s_per_gpu', 0):,.0f} tokens/s/GPU"
                if a.mode == "throughput"
                else "measured"
            )
            print(
                f"[bench] <<< {label}: {record['status']} in {outcome.wall_s:.0f} s: {summary} -> {path.name}",
                flush=True,
            )
    print(console_table(records), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.worker:
        if not (a.config and a.result_file and a.run_id):
            raise SystemExit("--worker needs --config, --result-file and --run-id")
        return _worker(a, a.result_file, a.run_id)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        # Started by zerorun/torchrun: these processes are one configuration's ranks.
        chosen, notes = catalogue.select(a.configs, int(os.environ["WORLD_SIZE"]))
        if len(chosen) != 1:
            raise SystemExit(
                f"under a launcher, --configs must name exactly one configuration (got {a.configs!r}; {notes})"
            )
        a.config = chosen[0].name
        run_id = a.run_id or os.environ.get("ZERORUN_RUN_ID") or _run_id(a, minute_only=True)
        result = {"run_id": run_id, "config": a.config, "mode": a.mode, "repeat": a.repeat}
        from benchmarks.results import record_filename

        a.out.mkdir(parents=True, exist_ok=True)
        return _worker(a, str(a.out / record_filename(result)), run_id)
    if a.steps < 10 and a.mode == "throughput":
        print(f"[bench] note: {a.steps} timed steps; the reported median wants >= 10", file=sys.stderr)
    return _orchestrate(a)


if __name__ == "__main__":
    raise SystemExit(main())
