"""zerorun's CPU Adam(W) kernel: one pass, a bf16 or fp32 gradient, split over a pool of threads
(docs/offload.md, "Bytes per element").

torch's fused CPU Adam kernel needs the gradient in the master's dtype (fp32), so the host
gradient buffer is fp32: the copy down writes 4 bytes per element into host memory and the step
reads them back. When the fp32 gradient holds single bf16 values exactly (one rank, one
micro-step, no clipping: ``options.narrow_grads``), 2 bytes carry the same number: this kernel
reads that bf16 gradient, widens it in registers and updates master, m and v in the same pass
(26 bytes of host memory per element instead of 28, plus 2 instead of 4 for the copy down). It
steps fp32 gradients too.

How a call is spread over the cores matters as much as the bytes. torch's kernel runs one
OpenMP region per call with a static split: each thread gets 1/N of the tile, so one thread
preempted by the training thread (running the next forward beside the step) holds up the
whole tile. Measured on the H200 host (benchmarks/results/gpu_runs/20261201T2254Z-h200-e5ed858):
the CPU update took 0.54 s per step at stage 2 with torch's kernel or this one under OpenMP,
0.35 s with this one on a pool (the same run, the same machine). The pool's threads take the
chunks from one queue -- a preempted thread simply takes fewer -- and sleep between calls
instead of spinning. ``ZERORUN_CPU_KERNEL=omp`` selects the OpenMP split (benchmarks).

The C source is built once per machine with the system C compiler (``cc``, tuned for this CPU)
into a cache directory and loaded with ctypes; calls release the GIL. Without a compiler, or
with ``ZERORUN_CPU_KERNEL=0``, ``load()`` returns None and offload steps fp32 gradients with
torch's fused kernel.

The arithmetic is torch's fused CPU Adam(W)'s, operation for operation (the same fused
multiply-adds, nothing else contracted; the scalars computed in double and rounded once): on
the same gradient both kernels give bitwise the same master, m and v (a test).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

__all__ = ["AdamKernel", "load", "reset", "pool_cores", "SOURCE"]

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float widen_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float widen_f32(float x) { return x; }

/* One Adam(W) update of n elements in place, the gradient in bf16 (G = uint16_t, widened here) or
   fp32. mode 0: Adam (L2 weight decay added to the gradient), 1: AdamW (decoupled). The scalars
   come rounded from double, as in torch. */
#define ADAM(NAME, G, WIDEN)                                                                    \
void NAME(float *restrict p, const G *restrict g, float *restrict m, float *restrict v,       \
          int64_t n, float one_minus_beta1, float beta2, float one_minus_beta2, float eps,       \
          float weight_decay, float decay, int mode, int maximize, float step_size,             \
          float bias_correction2_sqrt, int threads) {                                           \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                          \
    for (int64_t i = 0; i < n; ++i) {                                                           \
        float grad = WIDEN(g[i]);                                                               \
        if (maximize) grad = -grad;                                                             \
        float param = p[i];                                                                     \
        if (mode == 0) grad = fmaf(param, weight_decay, grad);                                  \
        else param = param * decay;                                                             \
        float ea = fmaf(one_minus_beta1, grad - m[i], m[i]);                                    \
        float eas = fmaf(grad * one_minus_beta2, grad, v[i] * beta2);                           \
        m[i] = ea;                                                                              \
        v[i] = eas;                                                                             \
        float denom = sqrtf(eas) / bias_correction2_sqrt + eps;                                 \
        p[i] = param - (step_size * ea) / denom;                                                \
    }                                                                                           \
}

ADAM(zerorun_adam_bf16_grad, uint16_t, widen_bf16)
ADAM(zerorun_adam_f32_grad, float, widen_f32)
"""

_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
_MIN_SPLIT = 1 << 16  # elements: below this one thread does the whole call
_lock = threading.Lock()


class AdamKernel:
    """The built kernel: ``step(...)`` updates one tile (fp32 master, m, v; bf16 or fp32 gradient)."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        f, i64, i32, ptr = ctypes.c_float, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        self._fns: dict[torch.dtype, Any] = {}
        for dtype, fn in ((torch.bfloat16, lib.zerorun_adam_bf16_grad), (torch.float32, lib.zerorun_adam_f32_grad)):
            fn.argtypes = [ptr, ptr, ptr, ptr, i64, f, f, f, f, f, f, i32, i32, f, f, i32]
            fn.restype = None
            self._fns[dtype] = fn
        # How the elements are split across cores: "omp" -- one OpenMP region per call (the
        # team belongs to the calling thread); "threads" -- a persistent pool of Python threads,
        # each running a contiguous chunk single-threaded (ctypes releases the GIL), which never
        # spin between calls. ZERORUN_CPU_KERNEL=omp|threads picks one (benchmarks).
        mode = os.environ.get("ZERORUN_CPU_KERNEL", "threads")
        self.mode = mode if mode in ("omp", "threads") else "threads"
        # One pool per size, kept for the process (two engines' workers may call at once; a
        # pool is never shut down under a caller).
        self._pools: dict[int, ThreadPoolExecutor] = {}
        self._pools_lock = threading.Lock()

    def step(
        self,
        p: torch.Tensor,
        g: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        *,
        step: float,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        decoupled: bool,
        maximize: bool,
        threads: int,
    ) -> None:
        n = p.numel()
        fn = self._fns.get(g.dtype)
        if fn is None:
            raise ValueError(f"adam kernel: the gradient must be bfloat16 or float32, got {g.dtype}")
        for t, dtype in ((p, torch.float32), (g, g.dtype), (exp_avg, torch.float32), (exp_avg_sq, torch.float32)):
            if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n:
                raise ValueError(f"adam kernel: expected a contiguous CPU {dtype} tensor of {n} elements, got {t.dtype} {tuple(t.shape)}")
        # The bias corrections in double, as torch's kernel computes them.
        bias_correction1 = 1.0 - beta1**step
        bias_correction2_sqrt = (1.0 - beta2**step) ** 0.5
        args = (
            1.0 - beta1,
            beta2,
            1.0 - beta2,
            eps,
            weight_decay,
            1.0 - lr * weight_decay,
            1 if decoupled else 0,
            1 if maximize else 0,
            lr / bias_correction1,
            bias_correction2_sqrt,
        )
        ptrs = (p.data_ptr(), g.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr())
        gsize = g.element_size()
        threads = max(1, threads)
        if self.mode == "omp" or threads == 1 or n < _MIN_SPLIT:
            fn(*ptrs, n, *args, threads if self.mode == "omp" else 1)
            return
        # Chunks of whole cache lines (16 floats), one per thread; the caller runs the first.
        per = (-(-n // threads) + 15) // 16 * 16
        bounds = [(a, min(a + per, n)) for a in range(0, n, per)]
        pool = self._threads(threads - 1)

        def run(a: int, b: int) -> None:
            fn(ptrs[0] + 4 * a, ptrs[1] + gsize * a, ptrs[2] + 4 * a, ptrs[3] + 4 * a, b - a, *args, 1)

        futures = [pool.submit(run, a, b) for a, b in bounds[1:]]
        run(*bounds[0])
        for f in futures:
            f.result()

    def _threads(self, size: int) -> ThreadPoolExecutor:
        with self._pools_lock:
            pool = self._pools.get(size)
            if pool is None:
                cores = pool_cores(size)
                init = None if cores is None else functools.partial(_pin_thread, iter(cores), threading.Lock())
                pool = self._pools[size] = ThreadPoolExecutor(size, thread_name_prefix="zerorun-adam", initializer=init)
            return pool


def pool_cores(size: int) -> list[int] | None:
    """The cores a pool of ``size`` threads is pinned to, one each (``ZERORUN_CPU_PIN=1``): the
    last ``size`` of the cores this process may use, so the first stay with the threads that
    are not pinned (the caller, which runs a chunk itself, and the training thread). None when
    pinning is off, or when this process may not use more cores than the pool (nothing to
    keep apart) -- or when it shares its cores with other ranks on the node (LOCAL_WORLD_SIZE
    above 1 and no affinity of its own): two ranks' pools would be pinned to the same cores."""
    if os.environ.get("ZERORUN_CPU_PIN", "0") != "1" or not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    if len(allowed) <= size or (local not in ("", "1") and len(allowed) >= (os.cpu_count() or 0)):
        return None
    return allowed[-size:]


def _pin_thread(cores: Any, lock: threading.Lock) -> None:
    """Pool thread initializer: this thread (pid 0: the caller) on the next core of ``cores``."""
    with lock:
        core = next(cores, None)
    if core is not None:
        try:
            os.sched_setaffinity(0, {core})
        except OSError:
            pass


def _cache_dir() -> Path:
    root = os.environ.get("ZERORUN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "zerorun"
    )
    return Path(root) / "kernels"


def _cpu_id() -> str:
    """What ``-march=native`` compiled for: a cache shared across machines (a home directory on
    a cluster's file system) must not hand one CPU's library to another."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(sorted(set(keep)))


def _build(compiler: str, out: Path) -> None:
    """Compile into a temporary file beside ``out`` and rename it into place (ranks of one node
    may build at the same time: each sees either nothing or a whole library)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "adam.c"
        src.write_text(SOURCE)
        lib = Path(tmp) / out.name
        subprocess.run([compiler, *_FLAGS, str(src), "-o", str(lib), "-lm"], check=True, capture_output=True, timeout=120)
        os.replace(lib, out)


@functools.cache
def load() -> AdamKernel | None:
    """The kernel, built on first use (cached per machine and source); None when disabled
    (``ZERORUN_CPU_KERNEL=0``) or when it cannot be built here. Decided once per process (the
    tile loop asks for every tile); ``reset()`` forgets the answer."""
    return _find()


def reset() -> None:
    load.cache_clear()


def _find() -> AdamKernel | None:
    if os.environ.get("ZERORUN_CPU_KERNEL", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    key = hashlib.sha256("\0".join([SOURCE, *_FLAGS, compiler, _cpu_id()]).encode()).hexdigest()[:16]
    path = _cache_dir() / f"adam_{key}.so"
    try:
        with _lock:  # (threads of one process; processes are kept apart by _build's rename)
            if not path.exists():
                _build(compiler, path)
        return AdamKernel(ctypes.CDLL(str(path)), path)
    except (OSError, subprocess.SubprocessError):
        return None
