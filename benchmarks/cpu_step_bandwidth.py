"""The exact CPU optimizer step against the host's memory bandwidth (docs/offload.md, issue 17).

The CPU Adam step of optimizer offload is bound by host memory bandwidth, not arithmetic: per
element it must read the fp32 master, gradient, m and v and write master, m and v back. This
benchmark measures, on this machine and in one process:

* a STREAM-like bandwidth (copy, scale, add, triad on fp32 tensors far larger than the caches;
  STREAM's byte counting: copy/scale 8 B, add/triad 12 B per element);
* the CPU step as zerorun runs it (`offload.adam.adam_tile` over `PIPELINE_TILE` tiles, torch's
  fused CPU AdamW kernel), the same kernel over the whole tensor, and torch's default AdamW
  step, each as G elements/s and GB/s at the step's minimum traffic (28 B per element);
  all kernels interleaved round by round (a shared machine's load hits them alike), best and
  median of the rounds kept;
* the per-element byte account of one exact offloaded step (host memory traffic of the gradient
  copy down, the step and the parameter copy up), written into the result file.

    python benchmarks/cpu_step_bandwidth.py                      # all cores of this process
    python benchmarks/cpu_step_bandwidth.py --threads 1 --numel 16M
    python benchmarks/cpu_step_bandwidth.py --sweep 8,12,15,16 --pin none,affinity,omp --numel 128M --dma

``--sweep`` runs one child process per (thread count, pinning) pair and writes one record with
all of them (``pin``: ``none``; ``affinity``: the process restricted to the first N allowed
cores with ``os.sched_setaffinity``; ``omp``: the same plus ``OMP_PROC_BIND=close
OMP_PLACES=cores``, each OpenMP thread on a core of its own). Besides the kernels above each
child times the variants the offload step could use (``--variants``): the tiled step at other
tile sizes, run from a worker thread as ``offload.runner`` does, followed by a bf16 cast of the
updated tile (the parameter-offload write-back), and with a bf16 gradient widened chunk by
chunk (26 B/element). ``--dma`` (CUDA only) times the tiled step again while a thread keeps
pinned host<->device copies running (what the offloaded step competes with).

Writes `benchmarks/results/cpu_step_bandwidth_<host tag>.json` (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# Host memory traffic per element of one exact offloaded step (CPU optimizer, Adam(W), fp32
# masters and states; runtime/offload/host_placement.py), bytes. The DMA engines' traffic counts too:
# it competes with the CPU step for the same memory.
STEP_BYTES: dict[str, dict[str, Any]] = {
    "gradient_down": {
        "bytes": 4,
        "what": "D2H of the fp32 gradient shard into pinned host memory (DMA write)",
    },
    "adam_read": {"bytes": 16, "what": "fused CPU AdamW reads master, gradient, m, v (fp32)"},
    "adam_write": {"bytes": 12, "what": "fused CPU AdamW writes master, m, v (fp32), one pass"},
    "parameter_up": {
        "bytes": 4,
        "what": "H2D of the updated fp32 master tile (DMA read); cast to bf16 on the GPU, no CPU pass",
    },
}
# The same with the gradient exactly bf16 (runtime/offload/options.narrow_grads: one rank, one
# micro-step, no clipping): copied down as bf16 and widened inside zerorun's kernel (cpu_kernel.py).
NARROW_STEP_BYTES: dict[str, dict[str, Any]] = {
    **STEP_BYTES,
    "gradient_down": {"bytes": 2, "what": "D2H of the gradient cast to bf16 on the GPU (exact: it holds bf16 values)"},
    "adam_read": {"bytes": 14, "what": "zerorun's CPU kernel reads master, m, v (fp32) and the bf16 gradient"},
}
ADAM_MIN_BYTES = 28  # read p, g, m, v + write p, m, v


def _time(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def kernels(
    numel: int, *, default_adamw: bool = True, variants: bool = False
) -> dict[str, tuple[Any, float, str]]:
    """name -> (callable, bytes per element, kind): the STREAM kernels and the CPU steps
    (``variants``: also the alternatives the offload step could use, module docstring)."""
    import torch

    sys.path.insert(0, str(REPO))
    from zerorun.runtime.offload.adam import AdamHyper, adam_tile
    from zerorun.runtime.offload.host import tiles
    from zerorun.runtime.offload.options import PIPELINE_TILE

    a = torch.full((numel,), 1.0)
    b = torch.full((numel,), 2.0)
    c = torch.zeros(numel)
    s = 3.0
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(numel, generator=gen)
    g = torch.randn(numel, generator=gen) * 1e-3
    m = torch.zeros(numel)
    v = torch.zeros(numel)
    step = torch.tensor(0.0)
    h = AdamHyper(
        lr=1e-4,
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
        weight_decay=0.01,
        amsgrad=False,
        maximize=False,
        decoupled=True,
    )
    parts = tiles(numel, PIPELINE_TILE)

    def zerorun_tiles() -> None:
        step.add_(1)
        for lo, hi in parts:
            adam_tile(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], None, step, h)

    def fused_whole() -> None:
        step.add_(1)
        adam_tile(p, g, m, v, None, step, h)

    table: dict[str, tuple[Any, float, str]] = {
        "copy": (lambda: c.copy_(a), 8, "stream"),
        "scale": (lambda: torch.mul(c, s, out=b), 8, "stream"),
        "add": (lambda: torch.add(a, b, out=c), 12, "stream"),
        "triad": (lambda: torch.add(b, c, alpha=s, out=a), 12, "stream"),
        "zerorun_tiles": (zerorun_tiles, ADAM_MIN_BYTES, "adam"),
        "fused_whole": (fused_whole, ADAM_MIN_BYTES, "adam"),
    }
    from zerorun.runtime.offload import cpu_kernel

    kernel = cpu_kernel.load()
    if kernel is not None:
        # A bf16 gradient widened inside the one-pass kernel (options.narrow_grads): 26 B/element,
        # split across a pool of threads (its default) or by one OpenMP region per call.
        g16 = g.to(torch.bfloat16)

        def bf16_grad(mode: str, tiled: bool) -> Any:
            def run() -> None:
                kernel.mode = mode
                step.add_(1)
                for lo, hi in parts if tiled else [(0, numel)]:
                    adam_tile(p[lo:hi], g16[lo:hi], m[lo:hi], v[lo:hi], None, step, h)

            return run

        for mode in ("threads", "omp"):
            table[f"kernel_bf16_grad_tiles_{mode}"] = (bf16_grad(mode, True), ADAM_MIN_BYTES - 2, "adam")
            table[f"kernel_bf16_grad_whole_{mode}"] = (bf16_grad(mode, False), ADAM_MIN_BYTES - 2, "adam")
    if default_adamw:
        param = torch.nn.Parameter(p.clone())
        param.grad = g.clone()
        opt = torch.optim.AdamW([param], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
        table["torch_default_adamw"] = (opt.step, ADAM_MIN_BYTES, "adam")
    if variants:
        table.update(_variants(p, g, m, v, step, h, adam_tile, tiles, PIPELINE_TILE))
    return table


def _variants(
    p: Any, g: Any, m: Any, v: Any, step: Any, h: Any, adam_tile: Any, tiles: Any, pipeline_tile: int
) -> dict[str, tuple[Any, float, str]]:
    """The tiled step as offload could run it otherwise (same kernel, same math)."""
    import threading

    import torch

    numel = p.numel()
    threads = torch.get_num_threads()
    out: dict[str, tuple[Any, float, str]] = {}

    def tiled(tile: int) -> Any:
        parts = tiles(numel, tile)

        def run() -> None:
            step.add_(1)
            for lo, hi in parts:
                adam_tile(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], None, step, h)

        return run

    for tile in (1 << 20, 1 << 22):
        out[f"tiles_{tile >> 20}M"] = (tiled(tile), ADAM_MIN_BYTES, "adam")

    # From a worker thread with its own intra-op thread count (offload.runner.StepRunner).
    pool_fn = tiled(pipeline_tile)
    box: dict[str, Any] = {}
    ready, done = threading.Event(), threading.Event()

    def worker() -> None:
        torch.set_num_threads(threads)
        while True:
            ready.wait()
            ready.clear()
            if box.get("stop"):
                return
            pool_fn()
            done.set()

    threading.Thread(target=worker, daemon=True).start()

    def on_worker() -> None:
        ready.set()
        done.wait()
        done.clear()

    out["tiles_on_worker_thread"] = (on_worker, ADAM_MIN_BYTES, "adam")

    # Parameter offload's write-back: the updated fp32 tile cast into a bf16 host shard, right
    # after its step (28 B + read 4 + write 2).
    p16 = torch.empty(numel, dtype=torch.bfloat16)
    cast_parts = tiles(numel, 1 << 22)

    def adam_then_cast() -> None:
        step.add_(1)
        for lo, hi in cast_parts:
            adam_tile(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], None, step, h)
            p16[lo:hi].copy_(p[lo:hi])

    out["tiles_4M_then_cast_bf16"] = (adam_then_cast, ADAM_MIN_BYTES + 6, "adam")

    # A bf16 gradient (2 B down instead of 4) widened chunk by chunk into a cache-sized fp32
    # scratch just before the step reads it: 26 B/element of memory traffic.
    g16 = g.to(torch.bfloat16)

    def widened(chunk: int) -> Any:
        scratch = torch.empty(chunk)
        parts = tiles(numel, chunk)

        def run() -> None:
            step.add_(1)
            for lo, hi in parts:
                sg = scratch[: hi - lo]
                sg.copy_(g16[lo:hi])
                adam_tile(p[lo:hi], sg, m[lo:hi], v[lo:hi], None, step, h)

        return run

    out["bf16_grad_widened_256K"] = (widened(1 << 18), ADAM_MIN_BYTES - 2, "adam")
    out["bf16_grad_widened_2M"] = (widened(1 << 21), ADAM_MIN_BYTES - 2, "adam")

    # The same split across `threads` Python threads, one intra-op thread each (no OpenMP fork
    # per chunk; the kernels release the GIL), each widening 256K chunks of its own range.
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(threads, initializer=lambda: torch.set_num_threads(1))
    chunk = 1 << 18
    scratches = [torch.empty(chunk) for _ in range(threads)]
    per = -(-numel // threads)

    def part(j: int) -> None:
        sg_all = scratches[j]
        for lo in range(j * per, min(numel, (j + 1) * per), chunk):
            hi = min(lo + chunk, (j + 1) * per, numel)
            sg = sg_all[: hi - lo]
            sg.copy_(g16[lo:hi])
            adam_tile(p[lo:hi], sg, m[lo:hi], v[lo:hi], None, step, h)

    def widened_threads() -> None:
        step.add_(1)
        list(pool.map(part, range(threads)))

    out["bf16_grad_widened_256K_py_threads"] = (widened_threads, ADAM_MIN_BYTES - 2, "adam")

    def tiles_threads_part(j: int) -> None:
        lo, hi = j * per, min(numel, (j + 1) * per)
        for a in range(lo, hi, 1 << 20):
            b = min(a + (1 << 20), hi)
            adam_tile(p[a:b], g[a:b], m[a:b], v[a:b], None, step, h)

    def tiles_threads() -> None:
        step.add_(1)
        list(pool.map(tiles_threads_part, range(threads)))

    out["tiles_1M_py_threads"] = (tiles_threads, ADAM_MIN_BYTES, "adam")
    return out


def dma_contention(numel: int, rounds: int) -> dict[str, Any] | None:
    """The tiled step alone and while a thread keeps pinned H2D + D2H copies (256 MB each way)
    running, interleaved; the copies' GB/s during the step. None without CUDA."""
    import threading

    import torch

    if not torch.cuda.is_available():
        return None
    table = kernels(numel, default_adamw=False)
    step_fn = table["zerorun_tiles"][0]
    n = 64 << 20
    host_up = torch.empty(n, pin_memory=True)
    host_down = torch.empty(n, pin_memory=True)
    dev_a = torch.empty(n, device="cuda")
    dev_b = torch.empty(n, device="cuda")
    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    stop = threading.Event()
    moved = [0]

    def copies() -> None:
        while not stop.is_set():
            with torch.cuda.stream(up):
                dev_a.copy_(host_up, non_blocking=True)
            with torch.cuda.stream(down):
                host_down.copy_(dev_b, non_blocking=True)
            up.synchronize()
            down.synchronize()
            moved[0] += 2 * n * 4

    step_fn()
    alone: list[float] = []
    loaded: list[float] = []
    dma_rates: list[float] = []
    for _ in range(rounds):
        alone.append(_time(step_fn))
        stop.clear()
        moved[0] = 0
        th = threading.Thread(target=copies, daemon=True)
        th.start()
        time.sleep(0.05)
        t0, b0 = time.perf_counter(), moved[0]
        loaded.append(_time(step_fn))
        dma_rates.append((moved[0] - b0) / (time.perf_counter() - t0) / 1e9)
        stop.set()
        th.join()
    return {
        "tiles_alone_best_s": min(alone),
        "tiles_with_dma_best_s": min(loaded),
        "tiles_alone_median_s": sorted(alone)[len(alone) // 2],
        "tiles_with_dma_median_s": sorted(loaded)[len(loaded) // 2],
        "slowdown_median": sorted(loaded)[len(loaded) // 2] / sorted(alone)[len(alone) // 2],
        "dma_GBps_during_step_median": sorted(dma_rates)[len(dma_rates) // 2],
        "G_elements_per_s_alone": numel / min(alone) / 1e9,
        "G_elements_per_s_with_dma": numel / min(loaded) / 1e9,
    }


def measure(numel: int, rounds: int, **kw: Any) -> dict[str, dict[str, Any]]:
    """Every kernel once per round, interleaved (a shared machine's load hits all alike), the
    order reversed every other round; the best time of the rounds (STREAM's convention) and the
    median."""
    table = kernels(numel, **kw)
    times: dict[str, list[float]] = {name: [] for name in table}
    for fn, _, _ in table.values():
        fn()  # warm-up: page faults, thread pool
    names = list(table)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):  # no kernel always first or last
            times[name].append(_time(table[name][0]))
    out: dict[str, dict[str, Any]] = {}
    for name, (_, width, kind) in table.items():
        best = min(times[name])
        median = sorted(times[name])[len(times[name]) // 2]
        out[name] = {
            "kind": kind,
            "bytes_per_element": width,
            "best_s": best,
            "median_s": median,
            "GBps": width * numel / best / 1e9,
            "GBps_median": width * numel / median / 1e9,
            "G_elements_per_s": numel / best / 1e9,
        }
    return out


def parse_numel(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


PIN_MODES = ("none", "affinity", "omp")


def _pin(mode: str, threads: int) -> list[int] | None:
    """Restrict this process to the first ``threads`` allowed cores (before torch starts its
    thread pool); the cores chosen, or None when not pinned."""
    if mode == "none" or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    chosen = allowed[: max(1, min(threads, len(allowed)))]
    os.sched_setaffinity(0, chosen)
    return chosen


def sweep(args: argparse.Namespace) -> None:
    """One child process per (threads, pin mode); one record with every child's."""
    import subprocess
    import tempfile

    threads = [int(t) for t in args.sweep.split(",") if t.strip()]
    modes = [m.strip() for m in args.pin.split(",") if m.strip()]
    for m in modes:
        if m not in PIN_MODES:
            raise SystemExit(f"--pin: unknown mode {m!r} (choose from {', '.join(PIN_MODES)})")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for t in threads:
            for m in modes:
                out = Path(tmp) / f"t{t}_{m}.json"
                cmd = [sys.executable, str(Path(__file__).resolve()), "--threads", str(t), "--pin-mode", m,
                       "--numel", args.numel, "--rounds", str(args.rounds), "--out", str(out), "--no-default-adamw"]  # fmt: skip
                if args.variants:
                    cmd.append("--variants")
                if args.dma and t == max(threads) and m == modes[0]:
                    cmd.append("--dma")
                env = dict(os.environ)
                if m == "omp":
                    env.update(OMP_PROC_BIND="close", OMP_PLACES="cores")
                t0 = time.perf_counter()
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                print(done.stdout.rstrip(), flush=True)
                if done.returncode != 0:
                    print(f"threads {t} pin {m}: failed: {done.stderr[-2000:]}", file=sys.stderr, flush=True)
                    runs.append({"threads": t, "pin": m, "error": done.stderr[-2000:]})
                    continue
                rec = json.loads(out.read_text())
                rec["wall_s"] = time.perf_counter() - t0
                runs.append(rec)
    ok = [r for r in runs if "error" not in r]
    summary = [
        {
            "threads": r["threads"],
            "pin": r["pin"],
            "stream_best_GBps": r["stream_best_GBps"],
            **{f"{k}_GBps": v["GBps"] for k, v in r["adam"].items()},
            **{f"{k}_G_el_per_s": v["G_elements_per_s"] for k, v in r["adam"].items()},
        }
        for r in ok
    ]
    record = {
        "benchmark": "cpu_step_bandwidth_sweep",
        "host": platform.node(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "numel": parse_numel(args.numel),
        "summary": summary,
        "runs": runs,
        "command": " ".join(["python", "benchmarks/cpu_step_bandwidth.py", *sys.argv[1:]]),
    }
    out = args.out or REPO / "benchmarks" / "results" / f"cpu_step_bandwidth_sweep_{platform.node()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{'threads':>7} {'pin':>8} {'STREAM':>7} {'step GB/s':>9} {'G el/s':>7}  (28 B/element)")
    for row in summary:
        print(f"{row['threads']:>7} {row['pin']:>8} {row['stream_best_GBps']:>7.1f} {row['zerorun_tiles_GBps']:>9.1f} "
              f"{row['zerorun_tiles_G_el_per_s']:>7.3f}")  # fmt: skip
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", default="32M", help="elements per tensor (fp32; default 32M = 128 MB)")
    ap.add_argument(
        "--threads", type=int, default=0, help="intra-op threads (0: the cores this process may use)"
    )
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds; best and median kept")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--sweep",
        default=None,
        help="thread counts, e.g. 8,12,15,16: one child process per count and --pin mode",
    )
    ap.add_argument(
        "--pin", default="none", help=f"with --sweep: pinning modes, comma list of {', '.join(PIN_MODES)}"
    )
    ap.add_argument(
        "--pin-mode", default="none", choices=PIN_MODES, help="this process's pinning (sweep children)"
    )
    ap.add_argument(
        "--variants", action="store_true", help="also time the alternatives the offload step could use"
    )
    ap.add_argument(
        "--dma", action="store_true", help="CUDA: the tiled step alone and under pinned H2D/D2H copies"
    )
    ap.add_argument(
        "--no-default-adamw", action="store_true", help="skip torch's default AdamW (slow at large sizes)"
    )
    args = ap.parse_args()
    if args.sweep:
        sweep(args)
        return

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = args.threads or cores
    pinned = _pin(args.pin_mode, threads)

    import torch

    torch.set_num_threads(threads)
    numel = parse_numel(args.numel)
    load_before = os.getloadavg()[0]
    rows = measure(numel, args.rounds, default_adamw=not args.no_default_adamw, variants=args.variants)
    dma = dma_contention(numel, max(3, args.rounds // 2)) if args.dma else None
    bw = {k: v for k, v in rows.items() if v["kind"] == "stream"}
    adam = {k: v for k, v in rows.items() if v["kind"] == "adam"}
    peak = max(v["GBps"] for v in bw.values())
    for row in adam.values():
        row["fraction_of_stream_best"] = row["GBps"] / peak
    step_total = sum(x["bytes"] for x in STEP_BYTES.values())
    record = {
        "benchmark": "cpu_step_bandwidth",
        "device": "cpu",
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": cores,
        "threads": threads,
        "pin": args.pin_mode,
        "pinned_cores": pinned,
        "omp_env": {
            k: os.environ[k] for k in ("OMP_PROC_BIND", "OMP_PLACES", "OMP_NUM_THREADS") if k in os.environ
        },
        "torch": torch.__version__,
        "numel": numel,
        "rounds": args.rounds,
        # 1-minute load average before and after: on a shared machine, how contended it was
        "loadavg_1min": [load_before, os.getloadavg()[0]],
        "stream": bw,
        "adam": adam,
        "stream_best_GBps": peak,
        "dma_contention": dma,
        "offloaded_step_bytes_per_element": {**STEP_BYTES, "total": step_total},
        "offloaded_step_bytes_per_element_bf16_gradient": {
            **NARROW_STEP_BYTES,
            "total": sum(x["bytes"] for x in NARROW_STEP_BYTES.values()),
        },
        # The exact offloaded step's host traffic at the best STREAM bandwidth: its floor.
        "floor_s_per_G_elements": step_total / peak,
        "command": " ".join(["python", "benchmarks/cpu_step_bandwidth.py", *sys.argv[1:]]),
    }
    out = args.out or REPO / "benchmarks" / "results" / f"cpu_step_bandwidth_cpu{cores}_t{threads}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(
        f"STREAM best {peak:.1f} GB/s ({threads} threads, pin {args.pin_mode}): "
        + ", ".join(f"{k} {v['GBps']:.1f}" for k, v in bw.items())
    )
    for name, row in adam.items():
        print(
            f"{name:>24}: {row['G_elements_per_s']:.3f} G el/s, {row['GBps']:.1f} GB/s at {row['bytes_per_element']} B/el "
            f"({row['fraction_of_stream_best']:.0%} of STREAM best; median {row['GBps_median']:.1f} GB/s)"
        )
    if dma is not None:
        print(
            f"tiled step alone {dma['G_elements_per_s_alone']:.3f} G el/s, under H2D+D2H copies "
            f"{dma['G_elements_per_s_with_dma']:.3f} (median slowdown {dma['slowdown_median']:.2f}x, "
            f"copies {dma['dma_GBps_during_step_median']:.1f} GB/s)"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
