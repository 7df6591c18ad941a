"""How the host memory under the CPU step is laid out and who runs it (docs/offload.md, issue 17).

The exact offloaded Adam step streams four arrays (fp32 master, m, v; a bf16 gradient) through
host memory. This benchmark times zerorun's CPU kernel (``runtime/offload/cpu_kernel.py``, over
``PIPELINE_TILE`` tiles, on its thread pool) in one process, every variant interleaved round by
round, on buffers allocated the way offload allocates them (``host.mapped_empty``):

* ``pages``: 4 KB pages, or transparent huge pages (2 MB, ``MADV_HUGEPAGE``: ``ZERORUN_HUGEPAGES``);
* ``pin``: the pool's threads each pinned to a core of its own (the default), or free
  (``ZERORUN_CPU_PIN=0`` in this process's environment: the pool's threads are made, and
  pinned, once per process);
* ``load``: the step alone; beside a Python thread that keeps the GIL busy (the training thread
  launching the next forward); beside pinned host->device copies from a large buffer (the
  parameter write-backs: every byte from DRAM) or from a small one that stays in the last-level
  cache (what a write-back staged through a small, reused buffer would cost).

It also records the machine's THP policy, the CPU and its last-level cache, and how much of each
allocation the kernel backed with huge pages (``AnonHugePages`` of the mapping).

    python benchmarks/host_pages_ab.py --numel 268435456 --out pinned.json
    ZERORUN_CPU_PIN=0 python benchmarks/host_pages_ab.py --numel 268435456 --out free.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def machine() -> dict[str, Any]:
    cpu = _read("/proc/cpuinfo") or ""
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("model name")), None)
    return {
        "host": platform.node(),
        "cpu": model or platform.machine(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "llc": _read("/sys/devices/system/cpu/cpu0/cache/index3/size"),
        "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag"),
        "kernel": platform.release(),
    }


def huge_bytes(ptr: int, nbytes: int) -> int:
    """AnonHugePages of the mappings overlapping [ptr, ptr + nbytes) (/proc/self/smaps)."""
    total, inside = 0, False
    for line in (_read("/proc/self/smaps") or "").splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < ptr + nbytes and hi > ptr
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=256 << 20)
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (0: cores - 1, as offload)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import torch

    from zerorun.runtime.offload import cpu_kernel
    from zerorun.runtime.offload.host import _cudart_register, mapped_empty
    from zerorun.runtime.offload.options import PIPELINE_TILE

    kernel = cpu_kernel.load()
    if kernel is None:
        raise SystemExit("host_pages_ab: zerorun's CPU kernel could not be built here (no C compiler?)")
    cores = machine()["cores"] or 1
    threads = args.threads or max(1, cores - 1)
    n = args.numel
    cuda = torch.cuda.is_available()

    arrays: dict[str, dict[str, Any]] = {}
    for pages in ("4k", "huge"):
        keep = []
        t = {}
        for name, dtype in (("p", torch.float32), ("g", torch.bfloat16), ("m", torch.float32), ("v", torch.float32)):
            buf, x = mapped_empty(n, dtype, huge=pages == "huge")
            keep.append(buf)
            if cuda and name in ("p", "g"):  # offload page-locks the master and the gradient buffer
                _cudart_register(x.data_ptr(), x.numel() * x.element_size())
            x.fill_(0.01 if name != "v" else 1e-6)
            t[name] = x
        arrays[pages] = {
            "t": t,
            "keep": keep,
            "huge_bytes": {k: huge_bytes(x.data_ptr(), x.numel() * x.element_size()) for k, x in t.items()},
        }

    stop = threading.Event()

    def busy() -> None:  # a Python thread holding the GIL most of the time
        x = 0
        while not stop.is_set():
            x += 1

    dma: dict[str, Any] = {}
    if cuda:
        big = torch.empty(64 << 20, pin_memory=True)  # 256 MB: far beyond any cache
        small = torch.empty(1 << 20, pin_memory=True)  # 4 MB, refilled by the CPU each round
        dev = torch.empty(64 << 20, device="cuda")
        stream = torch.cuda.Stream()
        moved = [0]

        def copies(src: torch.Tensor) -> None:
            while not stop.is_set():
                with torch.cuda.stream(stream):
                    for k in range(0, 64 << 20, src.numel()):
                        dev[k : k + src.numel()].copy_(src, non_blocking=True)
                stream.synchronize()
                moved[0] += (64 << 20) * 4
                if src is small:
                    small.add_(1.0)  # written by the CPU again: dirty lines in its cache

        dma = {"big": lambda: copies(big), "small": lambda: copies(small)}

    loads = ["alone", "busy"] + [f"dma_{k}" for k in dma]
    pin = "1" if kernel.pinned else "0"
    variants = [(pages, pin, load) for pages in ("4k", "huge") for load in loads]
    step = [0]

    def run(pages: str) -> None:
        t = arrays[pages]["t"]
        step[0] += 1
        for a in range(0, n, PIPELINE_TILE):
            b = min(a + PIPELINE_TILE, n)
            kernel.step(t["p"][a:b], t["g"][a:b], t["m"][a:b], t["v"][a:b], step=float(step[0]), lr=1e-4,
                        beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False,
                        threads=threads)  # fmt: skip

    times: dict[tuple[str, str, str], list[float]] = {v: [] for v in variants}
    dma_rate: dict[tuple[str, str, str], list[float]] = {v: [] for v in variants}
    for pages in arrays:
        run(pages)  # warm-up: pool threads, first touch done above
    for r in range(args.rounds):
        for v in variants if r % 2 == 0 else list(reversed(variants)):
            pages, _, load = v
            stop.clear()
            th = None
            if load != "alone":
                target = busy if load == "busy" else dma[load.split("_", 1)[1]]
                th = threading.Thread(target=target, daemon=True)
                th.start()
                time.sleep(0.02)
            b0 = moved[0] if cuda else 0
            t0 = time.perf_counter()
            run(pages)
            dt = time.perf_counter() - t0
            if cuda and load.startswith("dma"):
                dma_rate[v].append(((moved[0] - b0) / dt) / 1e9)
            stop.set()
            if th is not None:
                th.join()
            times[v].append(dt)

    rows = []
    for v in variants:
        ts = sorted(times[v])
        median = ts[len(ts) // 2]
        rates = sorted(dma_rate[v])
        rows.append({
            "pages": v[0], "pin": v[1], "load": v[2], "best_s": ts[0], "median_s": median,
            "G_elements_per_s_median": n / median / 1e9, "G_elements_per_s_best": n / ts[0] / 1e9,
            "GBps_median_26B": 26 * n / median / 1e9,
            "dma_GBps_median": rates[len(rates) // 2] if rates else None,
        })  # fmt: skip
    record = {
        "benchmark": "host_pages_ab",
        "machine": machine(),
        "numel": n,
        "threads": threads,
        "pinned_cores": kernel.pinned,
        "rounds": args.rounds,
        "torch": torch.__version__,
        "huge_bytes_per_array": {k: v["huge_bytes"] for k, v in arrays.items()},
        "rows": rows,
        "commit": os.environ.get("ZERORUN_BENCH_COMMIT"),
        "command": " ".join(["python", "benchmarks/host_pages_ab.py", *sys.argv[1:]]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["machine"]))
    print("huge bytes:", json.dumps(record["huge_bytes_per_array"]))
    print(f"{'pages':>5} {'pin':>3} {'load':>9} {'G el/s med':>10} {'best':>6} {'GB/s@26':>8} {'dma GB/s':>8}")
    for row in rows:
        dma_txt = f"{row['dma_GBps_median']:.1f}" if row["dma_GBps_median"] is not None else "-"
        print(f"{row['pages']:>5} {row['pin']:>3} {row['load']:>9} {row['G_elements_per_s_median']:>10.3f} "
              f"{row['G_elements_per_s_best']:>6.3f} {row['GBps_median_26B']:>8.1f} {dma_txt:>8}")  # fmt: skip


if __name__ == "__main__":
    main()
