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
    "gradient_down": {"bytes": 4, "what": "D2H of the fp32 gradient shard into pinned host memory (DMA write)"},
    "adam_read": {"bytes": 16, "what": "fused CPU AdamW reads master, gradient, m, v (fp32)"},
    "adam_write": {"bytes": 12, "what": "fused CPU AdamW writes master, m, v (fp32), one pass"},
    "parameter_up": {
        "bytes": 4,
        "what": "H2D of the updated fp32 master tile (DMA read); cast to bf16 on the GPU, no CPU pass",
    },
}
ADAM_MIN_BYTES = 28  # read p, g, m, v + write p, m, v


def _time(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def kernels(numel: int) -> dict[str, tuple[Any, float, str]]:
    """name -> (callable, bytes per element, kind): the STREAM kernels and the CPU steps."""
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
    h = AdamHyper(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, amsgrad=False, maximize=False, decoupled=True)
    parts = tiles(numel, PIPELINE_TILE)

    def zerorun_tiles() -> None:
        step.add_(1)
        for lo, hi in parts:
            adam_tile(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], None, step, h)

    def fused_whole() -> None:
        step.add_(1)
        adam_tile(p, g, m, v, None, step, h)

    param = torch.nn.Parameter(p.clone())
    param.grad = g.clone()
    opt = torch.optim.AdamW([param], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    return {
        "copy": (lambda: c.copy_(a), 8, "stream"),
        "scale": (lambda: torch.mul(c, s, out=b), 8, "stream"),
        "add": (lambda: torch.add(a, b, out=c), 12, "stream"),
        "triad": (lambda: torch.add(b, c, alpha=s, out=a), 12, "stream"),
        "zerorun_tiles": (zerorun_tiles, ADAM_MIN_BYTES, "adam"),
        "fused_whole": (fused_whole, ADAM_MIN_BYTES, "adam"),
        "torch_default_adamw": (opt.step, ADAM_MIN_BYTES, "adam"),
    }


def measure(numel: int, rounds: int) -> dict[str, dict[str, Any]]:
    """Every kernel once per round, interleaved (a shared machine's load hits all alike), the
    order reversed every other round; the best time of the rounds (STREAM's convention) and the
    median."""
    table = kernels(numel)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", default="32M", help="elements per tensor (fp32; default 32M = 128 MB)")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: the cores this process may use)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds; best and median kept")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = args.threads or cores
    torch.set_num_threads(threads)
    numel = parse_numel(args.numel)
    load_before = os.getloadavg()[0]
    rows = measure(numel, args.rounds)
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
        "torch": torch.__version__,
        "numel": numel,
        "rounds": args.rounds,
        # 1-minute load average before and after: on a shared machine, how contended it was
        "loadavg_1min": [load_before, os.getloadavg()[0]],
        "stream": bw,
        "adam": adam,
        "stream_best_GBps": peak,
        "offloaded_step_bytes_per_element": {**STEP_BYTES, "total": step_total},
        # The exact offloaded step's host traffic at the best STREAM bandwidth: its floor.
        "floor_s_per_G_elements": step_total / peak,
        "command": " ".join(["python", "benchmarks/cpu_step_bandwidth.py", *sys.argv[1:]]),
    }
    out = args.out or REPO / "benchmarks" / "results" / f"cpu_step_bandwidth_cpu{cores}_t{threads}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"STREAM best {peak:.1f} GB/s ({threads} threads): " + ", ".join(f"{k} {v['GBps']:.1f}" for k, v in bw.items()))
    for name, row in adam.items():
        print(
            f"{name:>20}: {row['G_elements_per_s']:.3f} G el/s, {row['GBps']:.1f} GB/s at 28 B/el "
            f"({row['fraction_of_stream_best']:.0%} of STREAM best; median {row['GBps_median']:.1f} GB/s)"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
