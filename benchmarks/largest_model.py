"""The largest GPT one GPU trains with stage 3 + parameter offload to the host + optimizer offload
to the host (`cpu`) or to files on the local disk (`nvme`), in one call of a few minutes.

    python -m benchmarks.largest_model run --budget-s 520 --out $OUT/largest_model.jsonl   # GPU machine
    python -m benchmarks.largest_model report          # benchmarks/results/largest_model/*.jsonl -> RESULTS.md

The search does not walk up from small models (each try of a multi-billion model takes a minute or
two). It predicts the size from the resources, tries it, then one step up (or down):

* `cpu`: host memory holds bf16 parameters 2 + fp32 master 4 + Adam 8 + fp32 gradient 4 = 18
  bytes per parameter (`zerorun estimate`'s terms for this config, plus its host buffers). The
  predicted size is the largest whose estimate + a fixed process overhead fits in the host's
  MemAvailable x `--host-fraction`.
* `nvme`: the disk holds master + Adam (12 B/param) and each step reads and writes them all, so
  the size is the least of what the disk's free space, the host memory and the call's remaining
  time allow (the disk's read/write speed is measured first, the way zerorun does its I/O).

A shape for a parameter count: the widest hidden size (from a ladder; heads of 128) that still
has at least hidden/256 layers, then as many layers as the count allows. "One step" is ±10 % of
the layers at that hidden size. Each try is its own process (benchmarks/largest_model_try.py)
with a hard time limit; the parent watches the host's MemAvailable and kills a try before the
machine runs out (recorded as the host-memory limit). A try is "ok" when it ran `--steps` (>= 20)
steps with finite losses, the mean of the last ones below the mean of the first ones. Every try
is appended to the JSON-lines file as soon as it ends, so a call cut short keeps what it found.

The report puts one table in benchmarks/RESULTS.md (benchmarks/report.py calls `render_section`):
per mode the largest size that trained, its tokens/s after warm-up, host bytes per parameter
(target <= 18), peak GPU memory, `zerorun estimate`'s model-state bytes beside the bytes
measured between steps (within 5 %), and the resource that stopped the next step up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

__all__ = [
    "Shape",
    "shape_for",
    "step",
    "predict",
    "largest_predicted",
    "disk_bandwidth",
    "run_try",
    "search",
    "main",
]

GIB = 1024**3
HIDDENS = (64, 128, 256, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192)
MIN_STEPS = 20
RESULTS_DIR = REPO / "benchmarks" / "results" / "largest_model"


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    vocab: int
    seq: int

    @property
    def heads(self) -> int:
        return self.hidden // 128 if self.hidden >= 1024 else max(1, self.hidden // 64)

    @property
    def params(self) -> int:
        # examples/gpt_model.count_parameters, without importing torch in the parent.
        d, L, V, S = self.hidden, self.layers, self.vocab, self.seq
        return L * (12 * d * d + 4 * d) + 2 * V * d + S * d + 2 * d


def _min_layers(hidden: int) -> int:
    return max(2, hidden // 256)


def shape_for(params: float, vocab: int, seq: int) -> Shape | None:
    """The widest ladder shape with at most `params` parameters and at least hidden/256 layers."""
    for d in sorted(HIDDENS, reverse=True):
        base = Shape(0, d, vocab, seq).params
        layers = int((params - base) // (12 * d * d + 4 * d)) if params > base else 0
        if layers >= _min_layers(d):
            return Shape(layers, d, vocab, seq)
    return None


def step(shape: Shape, direction: int) -> Shape | None:
    """One step up (+1) or down (-1): ±10 % of the layers (at least one) at the same hidden size."""
    layers = shape.layers + direction * max(1, round(0.1 * shape.layers))
    return Shape(layers, shape.hidden, shape.vocab, shape.seq) if layers >= 1 else None


@dataclass(frozen=True)
class Limits:
    host_bytes: float  # host memory the model states and buffers may take
    host_overhead: float  # what a try's process holds besides them (CUDA context, libraries)
    gpu_bytes: float  # the GPU's memory (None on CPU: not binding)
    disk_bytes: float  # free space under the NVMe path
    disk_read_bps: float | None = None
    disk_write_bps: float | None = None


def predict(
    shape: Shape, mode: str, micro_batch: int, sub_group: int, limits: Limits, steps: int
) -> dict[str, Any]:
    """What a try of `shape` needs by `zerorun estimate` (config arithmetic) and which resource binds."""
    from benchmarks.largest_model_try import ds_config
    from zerorun import estimate

    psi = shape.params
    est = estimate.model_state_bytes(
        psi, 1, ds_config(mode, micro_batch, "/nvme" if mode == "nvme" else None, sub_group)
    )
    host = est.total("cpu") + limits.host_overhead
    disk = est.total("nvme")
    gpu = 4.0 * psi  # the fp32 model is built on the GPU before initialize partitions it
    need: dict[str, float] = {"host RAM": host / limits.host_bytes, "GPU memory": gpu / limits.gpu_bytes}
    seconds = None
    if mode == "nvme":
        need["disk"] = disk / limits.disk_bytes
        if limits.disk_read_bps and limits.disk_write_bps:
            # Initial write of the files + per step: read and write master and states once.
            seconds = disk / limits.disk_write_bps + steps * (
                disk / limits.disk_read_bps + disk / limits.disk_write_bps
            )
    binding = max(need, key=lambda k: need[k])
    return {
        "params": psi,
        "host_bytes": host,
        "disk_bytes": disk,
        "gpu_build_bytes": gpu,
        "io_seconds": seconds,
        "use": need,
        "binding": binding,
        "fits": all(v <= 1.0 for v in need.values()),
    }


def largest_predicted(
    mode: str,
    vocab: int,
    seq: int,
    micro_batch: int,
    sub_group: int,
    limits: Limits,
    steps: int,
    seconds: float | None,
) -> tuple[Shape | None, str]:
    """The largest shape the prediction fits (and, for nvme with a time limit, whose I/O fits in
    `seconds`), with the resource that binds it. Bisection on the parameter count."""
    lo, hi = 1e3, 1e13
    best: tuple[Shape | None, str] = (None, "nothing fits")
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        shape = shape_for(mid, vocab, seq)
        if shape is None:
            lo = mid
            continue
        p = predict(shape, mode, micro_batch, sub_group, limits, steps)
        slow = seconds is not None and p["io_seconds"] is not None and p["io_seconds"] > seconds
        if p["fits"] and not slow:
            best = (shape, p["binding"])
            lo = mid
        else:
            hi = mid
        if hi / lo < 1.001:
            break
    shape = best[0]
    if shape is not None:  # what stops the next step up
        up = step(shape, 1)
        if up is not None:
            p = predict(up, mode, micro_batch, sub_group, limits, steps)
            over = {k: v for k, v in p["use"].items() if v > 1.0}
            slow = seconds is not None and p["io_seconds"] is not None and p["io_seconds"] > seconds
            label = (
                max(over, key=lambda k: over[k])
                if over
                else ("the call's time (disk speed)" if slow else p["binding"])
            )
            best = (shape, label)
    return best


def mem_available() -> int:
    """Host memory a new process can take: /proc/meminfo's MemAvailable, or less where this
    process's cgroup (a container's limit) leaves less (its limit - usage + reclaimable cache)."""
    with open("/proc/meminfo") as f:
        avail = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    for limit_f, usage_f in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit_txt = Path(limit_f).read_text().strip()
            usage = int(Path(usage_f).read_text())
        except (OSError, ValueError):
            continue
        if limit_txt == "max" or int(limit_txt) >= 1 << 60:
            break
        stat = Path(limit_f).with_name("memory.stat")
        cache = 0
        if stat.exists():
            for line in stat.read_text().splitlines():
                key, _, val = line.partition(" ")
                if key in ("inactive_file", "total_inactive_file"):
                    cache = int(val)
        return min(avail, int(limit_txt) - usage + cache)
    return avail


def filesystem(path: str) -> str:
    """The filesystem type `path` is on (/proc/mounts' longest matching mount point): tmpfs
    would put "NVMe" files in host memory."""
    real, best, kind = os.path.realpath(path), "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")):
                    if len(parts[1]) > len(best):
                        best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def disk_bandwidth(path: str, size: int = GIB, chunk: int = 16 * 1024**2) -> dict[str, Any]:
    """Sequential write (with fsync) and read speed of a file under `path`, with O_DIRECT where
    the filesystem takes it (zerorun's NVMe I/O falls back to buffered I/O the same way)."""
    import mmap

    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(1024) * (chunk // 1024))
    fd_path = os.path.join(path, f"zerorun-bw-{os.getpid()}")
    direct = hasattr(os, "O_DIRECT")
    out: dict[str, Any] = {}
    try:
        try:
            fd = os.open(
                fd_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600
            )
            os.write(fd, buf)
        except OSError:
            direct = False
            fd = os.open(fd_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.lseek(fd, 0, os.SEEK_SET)
        t0 = time.perf_counter()
        for _ in range(size // chunk):
            os.write(fd, buf)
        os.fsync(fd)
        out["write_bps"] = size / (time.perf_counter() - t0)
        os.close(fd)
        fd = os.open(fd_path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        t0 = time.perf_counter()
        while os.readv(fd, [buf]) > 0:
            pass
        out["read_bps"] = size / (time.perf_counter() - t0)
        os.close(fd)
    finally:
        if os.path.exists(fd_path):
            os.unlink(fd_path)
    out["direct_io"] = direct
    return out


_FAILURES = (  # (text in the try's output, status, limiting resource)
    ("CUDA out of memory", "gpu_oom", "GPU memory"),
    ("OutOfMemoryError", "gpu_oom", "GPU memory"),
    ("No space left on device", "disk_full", "disk"),
    ("cudaHostAlloc", "host_oom", "host RAM"),
    ("CUDA error: out of memory", "cuda_oom", "pinned host or GPU memory"),
    ("Cannot allocate memory", "host_oom", "host RAM"),
    ("std::bad_alloc", "host_oom", "host RAM"),
)


def run_try(
    shape: Shape,
    mode: str,
    *,
    micro_batch: int,
    steps: int,
    warmup: int,
    sub_group: int,
    nvme_path: str | None,
    timeout_s: float,
    min_available: int,
) -> dict[str, Any]:
    """One try in a child process: its result, or why it stopped (timeout, host memory running
    out under the watch, GPU out of memory, disk full, a crash)."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "largest_model_try.py")]
    args = dict(layers=shape.layers, hidden=shape.hidden, heads=shape.heads, vocab=shape.vocab, seq=shape.seq,
                micro_batch=micro_batch, steps=steps, warmup=warmup, sub_group=sub_group)  # fmt: skip
    for k, v in args.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    cmd += ["--optimizer", mode] + (["--nvme-path", nvme_path] if nvme_path else [])
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True)  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    status, low_mem = None, None
    while proc.poll() is None:
        if time.monotonic() - t0 > timeout_s:
            status = "timeout"
        elif (avail := mem_available()) < min_available:
            status, low_mem = "host_oom", avail
        if status:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    proc.wait()
    reader.join(timeout=10)
    wall = time.monotonic() - t0
    result = next((json.loads(x[7:]) for x in lines if x.startswith("RESULT ")), None)
    step_lines = [x.split() for x in lines if x.startswith("STEP ")]
    rec: dict[str, Any] = {
        "layers": shape.layers,
        "hidden": shape.hidden,
        "heads": shape.heads,
        "params": shape.params,
        "wall_s": wall,
        "returncode": proc.returncode,
        "steps_done": len(step_lines),
        "last_losses": [float(s[2]) for s in step_lines[-5:]],
        "init_s": next((float(x.split()[1]) for x in lines if x.startswith("INIT ")), None),
    }
    tail = "".join(lines[-40:])
    limit = None
    if status == "host_oom":
        limit = "host RAM"
        rec["mem_available_at_kill"] = low_mem
    elif status == "timeout":
        limit = "the call's time"
    elif result is None:
        status, limit = "crashed", None
        for text, st, lim in _FAILURES:
            if text in tail:
                status, limit = st, lim
                break
        if status == "crashed" and proc.returncode == -signal.SIGKILL:
            status, limit = "host_oom", "host RAM"  # the kernel's OOM killer
    else:
        ok = result["steps"] >= MIN_STEPS and result["finite"] and result["falling"]
        status = "ok" if ok else "not_learning"
    rec.update(status=status, limit=limit, result=result)
    if status != "ok":
        rec["output_tail"] = [x.rstrip()[:300] for x in lines[-15:]]
    return rec


def search(a: argparse.Namespace, mode: str, budget_s: float, emit: Any) -> list[dict[str, Any]]:
    """Predict, try, step up on success / down on failure, while the budget lasts."""
    t_end = time.monotonic() + budget_s
    nvme_dir, created = None, False
    total_mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    min_avail = int(min(2 * GIB, 0.03 * total_mem))
    host = a.host_budget_gb * GIB if a.host_budget_gb else mem_available() * a.host_fraction
    gpu = _gpu_bytes()
    base = dict(host_bytes=host, host_overhead=a.host_overhead_gb * GIB, gpu_bytes=gpu or float("inf"))
    disk_info: dict[str, Any] = {}
    if mode == "nvme":
        created = not os.path.exists(a.nvme_path)
        os.makedirs(a.nvme_path, exist_ok=True)
        nvme_dir = tempfile.mkdtemp(prefix="largest-", dir=a.nvme_path)
        disk_info = disk_bandwidth(nvme_dir, size=a.disk_probe_mib * 1024**2)
        free = shutil.disk_usage(nvme_dir).free * a.disk_fraction
        disk_info["free_bytes"] = shutil.disk_usage(nvme_dir).free
        disk_info["filesystem"] = filesystem(nvme_dir)
        limits = Limits(
            **base,
            disk_bytes=free,
            disk_read_bps=disk_info["read_bps"],
            disk_write_bps=disk_info["write_bps"],
        )
    else:
        limits = Limits(**base, disk_bytes=float("inf"))
    # The I/O of one try should fit in about half the mode's budget (init, teardown, a second try).
    io_budget = budget_s * a.io_fraction if mode == "nvme" else None
    shape, binding = largest_predicted(
        mode, a.vocab, a.seq, a.micro_batch, a.sub_group, limits, a.steps, io_budget
    )
    header = {
        "kind": "search",
        "mode": mode,
        "limits": {k: v for k, v in limits.__dict__.items()},
        "disk": disk_info,
        "predicted": None
        if shape is None
        else {**shape.__dict__, "params": shape.params, "next_step_limited_by": binding},
    }
    emit(header)
    tries: list[dict[str, Any]] = []
    tried: set[int] = set()
    direction = 0
    ended = "nothing predicted to fit" if shape is None else "a boundary found"
    while shape is not None and shape.layers not in tried:
        if len(tries) >= a.max_tries:
            ended = f"--max-tries {a.max_tries}"
            break
        left = t_end - time.monotonic()
        # A step up that fails (out of memory) fails early, during its set-up: worth starting
        # even when a full run would not fit in what is left (a timeout records how far it got).
        need = a.min_try_s
        if left < need:
            ended = "the call's time"
            break
        tried.add(shape.layers)
        p = predict(shape, mode, a.micro_batch, a.sub_group, limits, a.steps)
        rec = run_try(shape, mode, micro_batch=a.micro_batch, steps=a.steps, warmup=a.warmup, sub_group=a.sub_group,
                      nvme_path=nvme_dir, timeout_s=left, min_available=min_avail)  # fmt: skip
        rec.update(kind="try", mode=mode, predicted=p)
        tries.append(rec)
        emit(rec)
        ok = rec["status"] == "ok"
        if direction == 0:
            direction = 1 if ok else -1
        elif (direction == 1) != ok:
            break  # an up-step failed after a success, or a down-step succeeded after a failure
        shape = step(shape, direction)
    # Why the search stopped, and what the next size would have needed: without it a search cut
    # short by its time after successful steps up reads as if the prediction's limit were measured.
    emit(
        {
            "kind": "search_end",
            "mode": mode,
            "reason": ended,
            "next": None
            if shape is None or shape.layers in tried
            else predict(shape, mode, a.micro_batch, a.sub_group, limits, a.steps),
        }
    )
    if nvme_dir:
        shutil.rmtree(nvme_dir, ignore_errors=True)
        if created:
            os.rmdir(a.nvme_path)
    return tries


def _gpu_bytes() -> float | None:
    """Total GPU memory from nvidia-smi (the parent does not initialise CUDA: the tries need it)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout  # fmt: skip
        return float(out.split()[0]) * 1024**2
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="search (one call); appends each try to --out as it ends")
    r.add_argument("--modes", default="cpu,nvme")
    r.add_argument("--budget-s", type=float, default=520.0, help="the whole call")
    r.add_argument(
        "--cpu-share", type=float, default=0.6, help="of the budget for the cpu mode (nvme: the rest)"
    )
    r.add_argument(
        "--out", type=Path, default=None, help="JSON lines (default: results/largest_model/<run>.jsonl)"
    )
    r.add_argument("--vocab", type=int, default=32000)
    r.add_argument("--seq", type=int, default=2048)
    r.add_argument("--micro-batch", type=int, default=4)
    r.add_argument("--steps", type=int, default=22)
    r.add_argument("--warmup", type=int, default=2)
    r.add_argument(
        "--sub-group", type=int, default=50_000_000, help="sub_group_size: the NVMe tile (elements)"
    )
    r.add_argument(
        "--host-budget-gb", type=float, default=None, help="instead of MemAvailable x --host-fraction"
    )
    r.add_argument("--host-fraction", type=float, default=0.9)
    r.add_argument("--host-overhead-gb", type=float, default=6.0, help="a try's process besides model states")
    r.add_argument(
        "--nvme-path",
        default=str(REPO / ".largest_model_nvme"),
        help="a directory on the local disk (default: in the checkout; /tmp may be tmpfs, i.e. memory)",
    )
    r.add_argument("--disk-fraction", type=float, default=0.9)
    r.add_argument("--disk-probe-mib", type=int, default=1024)
    r.add_argument(
        "--io-fraction", type=float, default=0.5, help="nvme: share of its budget the I/O may take"
    )
    r.add_argument("--min-try-s", type=float, default=60.0, help="do not start a try with less time left")
    r.add_argument("--max-tries", type=int, default=4, help="per mode")
    q = sub.add_parser(
        "report", help="write the section into benchmarks/RESULTS.md (via benchmarks/report.py)"
    )
    q.add_argument("--results", type=Path, action="append")
    a = p.parse_args(argv)
    if a.cmd == "report":
        from benchmarks import report

        return report.main([x for d in (a.results or []) for x in ("--largest-model", str(d))])
    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = a.out or RESULTS_DIR / f"{run_id}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)

    def emit(rec: dict[str, Any]) -> None:
        with open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps({"run_id": run_id, **rec}) + "\n")
        keys = ("mode", "status", "layers", "hidden", "params", "wall_s", "limit", "reason", "machine")
        brief = {k: rec[k] for k in keys if k in rec}
        print(f"[largest_model] {rec.get('kind')}: {json.dumps(brief or rec.get('predicted'))}", flush=True)

    emit(
        {
            "kind": "env",
            "machine": _machine(),
            "command": " ".join(["python -m benchmarks.largest_model", *sys.argv[1:]]),
        }
    )
    t0 = time.monotonic()
    modes = [m for m in a.modes.split(",") if m]
    for i, mode in enumerate(modes):
        left = a.budget_s - (time.monotonic() - t0)
        share = (
            left
            if i == len(modes) - 1
            else (a.budget_s * a.cpu_share if mode == "cpu" else left / (len(modes) - i))
        )
        search(a, mode, min(share, left), emit)
    print(f"[largest_model] wrote {out} in {time.monotonic() - t0:.0f} s", flush=True)
    return 0


def _machine() -> str:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True, check=False).stdout.strip() if shutil.which("nvidia-smi") else ""  # fmt: skip
    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GIB
    return f"{gpu or 'no GPU'}; {os.cpu_count()} CPU cores, {mem:.0f} GiB host memory."


if __name__ == "__main__":
    raise SystemExit(main())
