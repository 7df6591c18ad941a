"""Launcher overhead: zerorun vs torchrun, and the console's throughput. Not a test.

    .venv/bin/python -m benchmarks.launch_overhead [--repeats 3] [--out benchmarks/results/launch_overhead.json]

1. Start-up: wall time from the command's start to every rank's first line on the launcher's
   stdout, for 1/2/4/8 CPU ranks, zerorun and torchrun in the same run (interleaved, median of
   the repeats). Two rank programs: `bare` prints at once (pure launcher cost) and `torch`
   imports torch first (what a training script pays; the launcher's share is the difference).
2. Console throughput: 4 ranks each print N lines as fast as they can through zerorun's plain
   console (stdout is a pipe this benchmark drains). Reported: lines/s reaching the console,
   the ranks' own time to write their lines compared with writing them to /dev/null without a
   launcher (the ranks must not be slowed: the launcher reads their pipes in a thread of its
   own and queues), and the launcher's peak RSS (the queue's cost when the console lags).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

_BARE = """import os, sys
sys.stdout.write(f"first {os.environ['RANK']}\\n"); sys.stdout.flush()
"""
_TORCH = """import os, sys
import torch  # noqa: F401
sys.stdout.write(f"first {os.environ['RANK']}\\n"); sys.stdout.flush()
"""
_FLOOD = """import os, sys, time
n = int(os.environ["ZR_LINES"])
rank = os.environ.get("RANK", "0")
line = f"rank {rank} " + "x" * 60
t0 = time.perf_counter()
for i in range(n):
    print(line, i)
dt = time.perf_counter() - t0
sys.stdout.flush()
print(f"WRITE_SECONDS {dt:.4f}", file=sys.stderr, flush=True)
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TORCH_CPP_LOG_LEVEL": "ERROR"})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _command(launcher: str, nproc: int, script: Path) -> list[str]:
    if launcher == "zerorun":
        return [sys.executable, "-m", "zerorun", "--num_gpus", str(nproc), str(script)]
    return [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", str(script)]


def time_to_first_lines(launcher: str, nproc: int, script: Path, timeout: float = 180) -> float:
    """Seconds from Popen to the moment every rank's first line was read."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        _command(launcher, nproc, script),
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


def startup(repeats: int, sizes: list[int], tmp: Path) -> list[dict[str, object]]:
    rows = []
    for kind, source in (("bare", _BARE), ("torch", _TORCH)):
        # Not "torch.py": the script's directory comes first on sys.path, so `import torch`
        # would import the script itself.
        script = tmp / f"prog_{kind}.py"
        script.write_text(source)
        for nproc in sizes:
            samples: dict[str, list[float]] = {"zerorun": [], "torchrun": []}
            load_before = os.getloadavg()[0]
            for _ in range(repeats):
                for launcher in ("zerorun", "torchrun"):  # interleaved: same machine load
                    samples[launcher].append(time_to_first_lines(launcher, nproc, script))
            row = {
                "program": kind,
                "ranks": nproc,
                **{f"{k}_s": round(statistics.median(v), 3) for k, v in samples.items()},
                **{f"{k}_min_s": round(min(v), 3) for k, v in samples.items()},
                # 1-minute load average (2 cores: above 2 means the numbers include waiting)
                "load_avg": [round(load_before, 1), round(os.getloadavg()[0], 1)],
                **{f"{k}_samples": [round(x, 3) for x in v] for k, v in samples.items()},
            }
            rows.append(row)
            print(
                f"start-up {kind:5s} {nproc} ranks: zerorun {row['zerorun_s']:.3f} s (min {row['zerorun_min_s']:.3f}), "
                f"torchrun {row['torchrun_s']:.3f} s (min {row['torchrun_min_s']:.3f}), load {row['load_avg']}",
                flush=True,
            )
    return rows


def _launcher_sampler(pid: int, result: list[float], stop: threading.Event) -> None:
    """Peak RSS and CPU seconds (user + system) of the launcher process itself."""
    peak, cpu = 0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    while not stop.is_set():
        try:
            with open(f"/proc/{pid}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            break
        stop.wait(0.02)
    result.extend([peak, cpu])


def console_throughput(lines_per_rank: int, ranks: int, tmp: Path) -> dict[str, object]:
    script = tmp / "flood.py"
    script.write_text(_FLOOD)
    env = {**_env(), "ZR_LINES": str(lines_per_rank)}

    # Baselines without a launcher: the same ranks writing to /dev/null, and to a pipe that a
    # `cat` drains (the cheapest possible reader: what a pipe costs by itself).
    def baseline(pipe: bool) -> list[float]:
        procs = []
        for r in range(ranks):
            out: object = subprocess.DEVNULL
            if pipe:
                out = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
            procs.append(
                (
                    subprocess.Popen(
                        [sys.executable, str(script)],
                        env={**env, "RANK": str(r)},
                        stdout=out.stdin if pipe else out,
                        stderr=subprocess.PIPE,
                        text=True,  # type: ignore[union-attr]
                    ),
                    out,
                )
            )
            if pipe:
                out.stdin.close()  # type: ignore[union-attr]
        times = []
        for p, out in procs:
            _, err = p.communicate(timeout=300)
            if pipe:
                out.wait(timeout=60)  # type: ignore[union-attr]
            times.append(float(err.split("WRITE_SECONDS")[1].split()[0]))
        return times

    base = baseline(pipe=False)
    piped = baseline(pipe=True)

    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerorun", "--num_gpus", str(ranks), str(script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    peak: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_launcher_sampler, args=(proc.pid, peak, stop), daemon=True)
    sampler.start()
    err_chunks: list[str] = []
    err_reader = threading.Thread(target=lambda: err_chunks.append(proc.stderr.read()), daemon=True)  # type: ignore[union-attr]
    err_reader.start()
    count = 0
    first_t = last_t = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if " rank " in line:
            count += 1
            last_t = time.perf_counter()
            if first_t is None:
                first_t = last_t
    proc.wait(timeout=300)
    stop.set()
    sampler.join()
    err_reader.join()
    writes = [float(x.split()[0]) for x in err_chunks[0].split("WRITE_SECONDS")[1:]]
    expected = lines_per_rank * ranks
    span = (last_t or 0) - (first_t or 0)
    result = {
        "ranks": ranks,
        "lines_per_rank": lines_per_rank,
        "lines_received": count,
        "lines_expected": expected,
        "console_lines_per_s": round(count / span) if span > 0 else None,
        "launcher_total_s": round(time.perf_counter() - t0, 3),
        "rank_write_s_under_zerorun": [round(w, 3) for w in writes],
        "rank_write_s_to_devnull": [round(b, 3) for b in base],
        "rank_write_s_to_pipe_drained_by_cat": [round(b, 3) for b in piped],
        "launcher_peak_rss_mib": round(peak[0] / 2**20, 1) if peak else None,
        # Sampled every 20 ms until the launcher exits: a lower bound, within one sample.
        "launcher_cpu_s": round(peak[1], 2) if peak else None,
        "launcher_cpu_us_per_line": round(peak[1] * 1e6 / max(count, 1), 2) if peak else None,
        "load_avg": [round(load_before, 1), round(os.getloadavg()[0], 1)],
    }
    print(
        f"console: {count}/{expected} lines, {result['console_lines_per_s']} lines/s; rank write time "
        f"{statistics.median(writes):.3f} s (vs {statistics.median(base):.3f} s to /dev/null, "
        f"{statistics.median(piped):.3f} s to a pipe drained by cat); "
        f"launcher peak RSS {result['launcher_peak_rss_mib']} MiB, CPU {result['launcher_cpu_us_per_line']} us/line",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--lines", type=int, default=100_000, help="lines per rank for the console test")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "launch_overhead.json"))
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        startup_rows = startup(args.repeats, sizes, Path(tmp))
        console = console_throughput(args.lines, 4, Path(tmp))
    import torch

    record = {
        "benchmark": "launch_overhead",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": len(os.sched_getaffinity(0)),
            "load_avg_at_start": os.getloadavg()[0],
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
        "startup_to_every_first_line": startup_rows,
        "console_throughput": console,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
