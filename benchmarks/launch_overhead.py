"""Launcher overhead: zerorun vs torchrun, measured in one interleaved harness. Not a test.

    .venv/bin/python -m benchmarks.launch_overhead output  [--repeats 7] [--ranks 4] [--lines 100000]
    .venv/bin/python -m benchmarks.launch_overhead startup [--repeats 3] [--sizes 1,2,4,8]
    .venv/bin/python -m benchmarks.launch_overhead report      (the output section as a markdown table)

Each command rewrites its own section of `benchmarks/results/launch_overhead.json` (with the
date, the machine and its load) and keeps the other section.

`output`: a chatty rank. N ranks each print L lines (~75 bytes) as fast as `print` goes and
report, in a file of their own (not through the streams being measured), the wall and CPU
seconds of their printing loop (final flush included) and their process's total CPU. The same
rank program runs in every mode:

    devnull          ranks started by the harness, stdout to /dev/null (the floor)
    pipe_cat         ranks started by the harness, stdout to one pipe drained by `grep -c`
    torchrun         `torchrun --standalone` (ranks inherit its stdout: the pipe to `grep -c`)
    torchrun_tee3    `torchrun --standalone --tee 3 --log-dir D` (ranks write files, torchrun tails them)
    zerorun          `zerorun --num_gpus N`, stdout a pipe to `grep -c` (the plain console)
    zerorun_log      the same with `--log-dir D` (every line also written to rankN.log)
    torchrun_tty     torchrun with a terminal (pty drained by `cat`) as stdout/stderr
    zerorun_tty      zerorun with a terminal: its default (rich) console with the live panel

Every repeat runs every mode once, in an order rotated by one each repeat (ABC.., BC..A, ...),
after one discarded warm-up round, so a change of machine load or a cold cache hits every
mode alike. Reported per mode: median and spread over the repeats of the slowest rank's write
wall time, the ranks' write CPU time, the job's wall time (start to exit, output drained), the
launcher's CPU (the launcher process tree's CPU from wait4 minus the ranks' own CPU, start-up
included) and, in the pipe modes, how many of the ranks' lines reached the reader whole (ranks
sharing one pipe interleave their buffered writes mid-line; zerorun must deliver every line
whole or the run fails).

Why the earlier numbers had /dev/null slower than a pipe: each baseline was one sample taken
once, before the other, at a load average of 13-18 on 2 cores; the write time then measures
mostly the wait for a core (100,000 prints take ~0.04 s of CPU; those samples took 4.4 s).
Here every mode gets the same load in turn, the warm-up round is dropped, and the write CPU
time (which waiting does not inflate) is reported beside the wall time.

`startup`: wall time from the command's start to every rank's first line on the launcher's
stdout, for 1/2/4/8 CPU ranks, zerorun and torchrun interleaved (median of the repeats). Rank
program `bare` prints at once (pure launcher cost); `torch` imports torch first.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import pty
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "launch_overhead.json"

OUTPUT_MODES = (
    "devnull",
    "pipe_cat",
    "torchrun",
    "torchrun_tee3",
    "zerorun",
    "zerorun_log",
    "torchrun_tty",
    "zerorun_tty",
)

# A rank's line, whole: `rank R xxx...x I`, after a launcher's prefix (`[R] `, `[default0]:`).
_WHOLE = r"^(\[[a-z0-9:]+\]:? *)?rank [0-9]+ x{60} [0-9]+$"
_FLOOD = """import json, os, resource, sys, time
n = int(os.environ["ZR_LINES"])
rank = os.environ.get("RANK", "0")
line = f"rank {rank} " + "x" * 60
t0, c0 = time.perf_counter(), time.process_time()
for i in range(n):
    print(line, i)
sys.stdout.flush()
dt, dc = time.perf_counter() - t0, time.process_time() - c0
ru = resource.getrusage(resource.RUSAGE_SELF)
with open(os.path.join(os.environ["ZR_RESULT_DIR"], f"rank{rank}.json"), "w") as fh:
    json.dump({"write_s": dt, "write_cpu_s": dc, "cpu_s": ru.ru_utime + ru.ru_stime}, fh)
"""

_BARE = """import os, sys
sys.stdout.write(f"first {os.environ['RANK']}\\n"); sys.stdout.flush()
"""
_TORCH = """import os, sys
import torch  # noqa: F401
sys.stdout.write(f"first {os.environ['RANK']}\\n"); sys.stdout.flush()
"""


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TORCH_CPP_LOG_LEVEL": "ERROR", **extra})
    # CPU ranks everywhere: on a GPU machine zerorun would otherwise put the ranks on the GPU
    # (and its shim would import torch to pick the device).
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("PYTHONUNBUFFERED", None)
    return env


def _launcher_command(launcher: str, nproc: int, script: Path) -> list[str]:
    if launcher == "zerorun":
        return [sys.executable, "-m", "zerorun", "--num_gpus", str(nproc), str(script)]
    # `python -m torch.distributed.run` is the `torchrun` command, wherever its script lies.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script)]


# --- output: a chatty rank ------------------------------------------------------------------


def _cpu_of(rusage: Any) -> float:
    return float(rusage.ru_utime + rusage.ru_stime)


def _wait4(pid: int) -> tuple[int, float]:
    """Exit status and the CPU of the process and every descendant it waited for."""
    _, status, rusage = os.wait4(pid, 0)
    return os.waitstatus_to_exitcode(status), _cpu_of(rusage)


def _terminal() -> tuple[int, int]:
    """A pty of 50 rows x 160 columns: (master, slave)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    return master, slave


def run_output_mode(mode: str, nproc: int, lines: int, script: Path, work: Path) -> dict[str, Any]:
    """One run of one mode; every figure of it."""
    results = work / "results"
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir(parents=True)
    logs = work / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    env = _env(ZR_LINES=str(lines), ZR_RESULT_DIR=str(results))
    tty = mode.endswith("_tty")
    if tty:
        master, sink_w = _terminal()
        drain = subprocess.Popen(["cat"], stdin=master, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(master)
        out_fd = err_fd = sink_w
    elif mode == "devnull":
        drain = None
        sink_w = os.open(os.devnull, os.O_WRONLY)
        out_fd, err_fd = sink_w, sink_w
    else:
        r, sink_w = os.pipe()
        # A reader about as cheap as `cat` to /dev/null that also counts the ranks' lines that
        # came whole: one rank's line, alone on its line, after the launcher's prefix if any.
        # (LC_ALL=C: in a UTF-8 locale grep takes ~14x the CPU, and the drain became the bottleneck.)
        drain = subprocess.Popen(
            ["grep", "-c", "-E", _WHOLE], stdin=r, stdout=subprocess.PIPE, text=True, env={**os.environ, "LC_ALL": "C"}
        )
        os.close(r)
        out_fd, err_fd = sink_w, sink_w
    base = mode.removesuffix("_tty")
    if base in ("devnull", "pipe_cat"):
        argvs = [[sys.executable, str(script)] for _ in range(nproc)]
        envs = [{**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc)} for r in range(nproc)]
    else:
        launcher = "zerorun" if base.startswith("zerorun") else "torchrun"
        argv = _launcher_command(launcher, nproc, script)
        if base == "torchrun_tee3":
            argv[3:3] = ["--tee", "3", "--log-dir", str(logs)]
        elif base == "zerorun_log":
            argv[3:3] = ["--log-dir", str(logs)]
        argvs, envs = [argv], [env]
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(a, env=e, stdin=subprocess.DEVNULL, stdout=out_fd, stderr=err_fd, start_new_session=True)
        for a, e in zip(argvs, envs, strict=True)
    ]
    os.close(sink_w)
    codes, tree_cpu = [], 0.0
    for p in procs:
        code, cpu = _wait4(p.pid)
        p.returncode = code
        codes.append(code)
        tree_cpu += cpu
    exited = time.perf_counter()
    drain_cpu, seen = 0.0, None
    if drain is not None:
        if drain.stdout is not None:
            seen = int(drain.stdout.read().strip() or 0)
            drain.stdout.close()
        _, drain_cpu = _wait4(drain.pid)
        drain.returncode = 0
    done = time.perf_counter()
    ranks = [json.loads((results / f"rank{r}.json").read_text()) for r in range(nproc)]
    if any(codes) or len(ranks) != nproc:
        raise RuntimeError(f"{mode}: exit codes {codes}, {len(ranks)} of {nproc} ranks reported")
    if seen is not None and seen != nproc * lines and mode.startswith("zerorun"):
        raise RuntimeError(f"{mode}: {seen} of the ranks' {nproc * lines} lines reached the reader")
    rank_cpu = sum(r["cpu_s"] for r in ranks)
    return {
        "mode": mode,
        "write_s_max": max(r["write_s"] for r in ranks),
        "write_s": [round(r["write_s"], 4) for r in ranks],
        "write_cpu_s": [round(r["write_cpu_s"], 4) for r in ranks],
        "job_wall_s": done - t0,
        "launcher_exit_s": exited - t0,
        # The launcher's own CPU: the tree's minus the ranks'; 0 when the harness starts the ranks.
        "launcher_cpu_s": max(0.0, tree_cpu - rank_cpu) if len(procs) == 1 else 0.0,
        "drain_cpu_s": drain_cpu,
        # The ranks' lines that reached the launcher's stdout whole (pipe modes; None: not
        # counted): ranks sharing one pipe (torchrun) interleave their buffered writes mid-line.
        "lines_whole": seen,
        "lines_not_whole": None if seen is None else nproc * lines - seen,
        "load_avg": round(os.getloadavg()[0], 2),
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def output(repeats: int, nproc: int, lines: int, modes: tuple[str, ...]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        script = work / "flood.py"
        script.write_text(_FLOOD)
        runs: list[dict[str, Any]] = []
        warmup = [run_output_mode(m, nproc, lines, script, work) for m in modes]
        for rep in range(repeats):
            order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
            for mode in order:
                row = run_output_mode(mode, nproc, lines, script, work)
                row["repeat"] = rep
                runs.append(row)
                print(
                    f"  repeat {rep} {mode:14s} write {row['write_s_max']:.3f} s (cpu "
                    f"{max(row['write_cpu_s']):.3f}), job {row['job_wall_s']:.2f} s, launcher cpu "
                    f"{row['launcher_cpu_s']:.2f} s, load {row['load_avg']}",
                    flush=True,
                )
    summary = {}
    for mode in modes:
        rows = [r for r in runs if r["mode"] == mode]
        summary[mode] = {
            "rank_write_s_slowest": _spread([r["write_s_max"] for r in rows]),
            "rank_write_cpu_s_slowest": _spread([max(r["write_cpu_s"]) for r in rows]),
            "job_wall_s": _spread([r["job_wall_s"] for r in rows]),
            "launcher_cpu_s": _spread([r["launcher_cpu_s"] for r in rows]),
            # Start-up included (torchrun's torch import, ~1.5 s of it here): not a per-line cost.
            "launcher_cpu_us_per_line": round(
                statistics.median(r["launcher_cpu_s"] for r in rows) * 1e6 / (nproc * lines), 2
            ),
        }
    return {
        "ranks": nproc,
        "lines_per_rank": lines,
        "repeats": repeats,
        "modes": list(modes),
        "summary": summary,
        "warmup_discarded": [{k: v for k, v in r.items() if k != "write_s"} for r in warmup],
        "runs": runs,
    }


# --- start-up -------------------------------------------------------------------------------


def time_to_first_lines(launcher: str, nproc: int, script: Path, timeout: float = 180) -> float:
    """Seconds from Popen to the moment every rank's first line was read."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        _launcher_command(launcher, nproc, script),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    seen: set[str] = set()
    elapsed = float("nan")
    deadline = t0 + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        if "first " in line:
            seen.add(line.split("first ", 1)[1].strip())
            if len(seen) == nproc:
                elapsed = time.perf_counter() - t0
                break
        if time.perf_counter() > deadline:
            break
    proc.stdout.close()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
    return elapsed


def startup(repeats: int, sizes: list[int]) -> list[dict[str, object]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, source in (("bare", _BARE), ("torch", _TORCH)):
            # Not "torch.py": the script's directory comes first on sys.path.
            script = Path(tmp) / f"prog_{kind}.py"
            script.write_text(source)
            for nproc in sizes:
                samples: dict[str, list[float]] = {"zerorun": [], "torchrun": []}
                load_before = os.getloadavg()[0]
                for rep in range(repeats):
                    order = ("zerorun", "torchrun") if rep % 2 == 0 else ("torchrun", "zerorun")
                    for launcher in order:
                        samples[launcher].append(time_to_first_lines(launcher, nproc, script))
                row = {
                    "program": kind,
                    "ranks": nproc,
                    **{f"{k}_s": round(statistics.median(v), 3) for k, v in samples.items()},
                    **{f"{k}_min_s": round(min(v), 3) for k, v in samples.items()},
                    "load_avg": [round(load_before, 1), round(os.getloadavg()[0], 1)],
                    **{f"{k}_samples": [round(x, 3) for x in v] for k, v in samples.items()},
                }
                rows.append(row)
                print(
                    f"start-up {kind:5s} {nproc} ranks: zerorun {row['zerorun_s']:.3f} s, "
                    f"torchrun {row['torchrun_s']:.3f} s, load {row['load_avg']}",
                    flush=True,
                )
    return rows


# --- the report -----------------------------------------------------------------------------


def _cell(v: dict[str, float], digits: int = 2) -> str:
    return f"{v['median']:.{digits}f} ({v['min']:.{digits}f}-{v['max']:.{digits}f})"


def report(record: dict[str, Any]) -> str:
    """The output section as the markdown table benchmarks/README.md quotes."""
    sec = record["sections"]["output"]
    head = (
        "| mode | rank write time, s | rank write CPU, s | job wall time, s | launcher CPU, s | "
        "whole lines |\n|---|---|---|---|---|---|"
    )
    rows = [head]
    total = sec["ranks"] * sec["lines_per_rank"]
    for mode in sec["modes"]:
        m = sec["summary"][mode]
        whole = [r.get("lines_whole") for r in sec["runs"] if r["mode"] == mode]  # (older records: none)
        if whole[0] is None:
            whole_text = "-"
        else:
            bad = [w for w in whole if w != total]
            whole_text = f"all ({total:,}) in {len(whole)}/{len(whole)} runs" if not bad else (
                f"{min(whole):,}-{max(whole):,} of {total:,}"
            )

        launcher = "-" if mode in ("devnull", "pipe_cat") else _cell(m["launcher_cpu_s"])
        rows.append(
            f"| {mode} | {_cell(m['rank_write_s_slowest'])} | {_cell(m['rank_write_cpu_s_slowest'], 3)} | "
            f"{_cell(m['job_wall_s'], 1)} | {launcher} | {whole_text} |"
        )
    loads = [r["load_avg"] for r in sec["runs"]]
    rows.append(
        f"\n{sec['ranks']} ranks x {sec['lines_per_rank']:,} lines, {sec['repeats']} rounds, {sec['date']}, "
        f"{sec['machine']['cpus']} CPUs, load average {min(loads):.1f}-{max(loads):.1f} during the runs "
        f"(at {sec['git_head']})."
    )
    return "\n".join(rows)


# --- the record -----------------------------------------------------------------------------


def _machine() -> dict[str, Any]:
    import torch

    return {
        "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def _git_head() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("output", "startup", "report"))
    parser.add_argument("--repeats", type=int, default=None, help="output: 7, startup: 3")
    parser.add_argument("--ranks", type=int, default=4, help="output: ranks per run")
    parser.add_argument("--lines", type=int, default=100_000, help="output: lines per rank")
    parser.add_argument("--modes", default=",".join(OUTPUT_MODES), help="output: modes to run")
    parser.add_argument("--sizes", default="1,2,4,8", help="startup: rank counts")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    out = Path(args.out)
    record: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    if args.what == "report":
        print(report(record))
        return
    if record.get("benchmark") != "launch_overhead" or "sections" not in record:
        record = {"benchmark": "launch_overhead", "sections": {}}
    section: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_head": _git_head(),
        "command": " ".join(["python -m benchmarks.launch_overhead", *sys.argv[1:]]),
        "machine": _machine(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    if args.what == "output":
        modes = tuple(m for m in args.modes.split(",") if m)
        unknown = sorted(set(modes) - set(OUTPUT_MODES))
        if unknown:
            parser.error(f"unknown modes {unknown}; known: {', '.join(OUTPUT_MODES)}")
        section.update(output(args.repeats or 7, args.ranks, args.lines, modes))
    else:
        section["startup_to_every_first_line"] = startup(args.repeats or 3, [int(s) for s in args.sizes.split(",")])
    section["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    section["self_cpu_s"] = round(_cpu_of(resource.getrusage(resource.RUSAGE_SELF)), 2)
    record["sections"][args.what] = section
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out} ({args.what})")


if __name__ == "__main__":
    main()
