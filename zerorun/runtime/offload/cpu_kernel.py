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
0.35 s with this one on a pool. The pool's threads claim small chunks of the tile from one
counter -- a preempted thread simply takes fewer -- and sleep between calls instead of
spinning. They are C threads: a pool of Python threads (each chunk handed over through the
GIL) ran 19x slower beside a Python thread that keeps the GIL busy, as the training thread
does (benchmarks/results/host_pages_ab_h200_eee635d.json, "busy"). ``ZERORUN_CPU_KERNEL=omp``
selects the OpenMP split (benchmarks); the pool's threads are pinned to cores (``pool_cores``;
``ZERORUN_CPU_PIN=0`` leaves them free).

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
from pathlib import Path
from typing import Any

import torch

from zerorun.runtime.offload.options import cores_per_rank, rank_cores

__all__ = ["AdamKernel", "load", "reset", "pool_cores", "SOURCE"]

SOURCE = r"""
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>

static inline float widen_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float widen_f32(float x) { return x; }

/* One Adam(W) update of elements [lo, hi) in place, the gradient in bf16 (G = uint16_t, widened
   here) or fp32. mode 0: Adam (L2 weight decay added to the gradient), 1: AdamW (decoupled). The
   scalars come rounded from double, as in torch. */
typedef struct {
    float one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay, step_size, bias_correction2_sqrt;
    int mode, maximize;
} hyper_t;

#define ADAM_RANGE(NAME, G, WIDEN)                                                              \
static void NAME(float *restrict p, const G *restrict g, float *restrict m, float *restrict v, \
                 int64_t lo, int64_t hi, const hyper_t *h) {                                   \
    const float one_minus_beta1 = h->one_minus_beta1, beta2 = h->beta2;                        \
    const float one_minus_beta2 = h->one_minus_beta2, eps = h->eps;                            \
    const float weight_decay = h->weight_decay, decay = h->decay, step_size = h->step_size;     \
    const float bias_correction2_sqrt = h->bias_correction2_sqrt;                              \
    const int mode = h->mode, maximize = h->maximize;                                          \
    for (int64_t i = lo; i < hi; ++i) {                                                        \
        float grad = WIDEN(g[i]);                                                              \
        if (maximize) grad = -grad;                                                            \
        float param = p[i];                                                                    \
        if (mode == 0) grad = fmaf(param, weight_decay, grad);                                 \
        else param = param * decay;                                                            \
        float ea = fmaf(one_minus_beta1, grad - m[i], m[i]);                                   \
        float eas = fmaf(grad * one_minus_beta2, grad, v[i] * beta2);                          \
        m[i] = ea;                                                                             \
        v[i] = eas;                                                                            \
        float denom = sqrtf(eas) / bias_correction2_sqrt + eps;                                \
        p[i] = param - (step_size * ea) / denom;                                               \
    }                                                                                          \
}

ADAM_RANGE(adam_bf16_range, uint16_t, widen_bf16)
ADAM_RANGE(adam_f32_range, float, widen_f32)

static void adam_range(int bf16, void *p, const void *g, void *m, void *v, int64_t lo, int64_t hi,
                       const hyper_t *h) {
    if (bf16) adam_bf16_range(p, g, m, v, lo, hi, h);
    else adam_f32_range(p, g, m, v, lo, hi, h);
}

static void fill_hyper(hyper_t *h, float one_minus_beta1, float beta2, float one_minus_beta2, float eps,
                       float weight_decay, float decay, int mode, int maximize, float step_size,
                       float bias_correction2_sqrt) {
    h->one_minus_beta1 = one_minus_beta1; h->beta2 = beta2; h->one_minus_beta2 = one_minus_beta2;
    h->eps = eps; h->weight_decay = weight_decay; h->decay = decay; h->mode = mode;
    h->maximize = maximize; h->step_size = step_size; h->bias_correction2_sqrt = bias_correction2_sqrt;
}

/* The OpenMP split (ZERORUN_CPU_KERNEL=omp): one parallel region per call, static. */
void zerorun_adam_omp(int bf16, void *p, const void *g, void *m, void *v, int64_t n,
                      float one_minus_beta1, float beta2, float one_minus_beta2, float eps,
                      float weight_decay, float decay, int mode, int maximize, float step_size,
                      float bias_correction2_sqrt, int threads) {
    hyper_t h;
    fill_hyper(&h, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay, mode, maximize,
               step_size, bias_correction2_sqrt);
    #pragma omp parallel num_threads(threads)
    {
        int64_t t = 0, nt = 1;
#ifdef _OPENMP
        extern int omp_get_thread_num(void);
        extern int omp_get_num_threads(void);
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        int64_t per = (n + nt - 1) / nt;
        int64_t lo = t * per, hi = lo + per < n ? lo + per : n;
        if (lo < hi) adam_range(bf16, p, g, m, v, lo, hi, &h);
    }
}

/* The pool (the default): persistent pthreads that sleep between calls; a call hands them the
   tile as chunks of CHUNK elements claimed from an atomic counter, so a thread that is preempted
   (the training thread runs beside the step) takes fewer chunks instead of holding up the tile.
   The caller works too and returns when every chunk is done. No Python and no GIL inside: a
   busy Python thread cannot delay the hand-offs. */
#define CHUNK 32768
#define MAX_THREADS 1024

static struct {
    pthread_mutex_t mu;
    pthread_cond_t start, done;
    pthread_mutex_t call;         /* one call at a time (two engines' workers may call at once) */
    int size;                     /* pool threads made */
    int want;                     /* of them, how many take part in the current call */
    int64_t generation, finished;
    int bf16;
    void *p, *m, *v;
    const void *g;
    int64_t n;
    hyper_t h;
    int64_t next;                 /* the next chunk to claim (atomic) */
    int cores[MAX_THREADS];
    int ncores;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_MUTEX_INITIALIZER};

/* A fork child has only the forking thread: none of the pool's, and mutexes and condition
   variables in whatever state the parent's threads left them (a broadcast would wait for a
   waiter that is not there). Start the child with a fresh, empty pool. */
static void child_after_fork(void) {
    pthread_mutex_init(&pool.mu, NULL);
    pthread_mutex_init(&pool.call, NULL);
    pthread_cond_init(&pool.start, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.size = 0;
    pool.generation = 0;
}

__attribute__((constructor)) static void register_fork_handler(void) {
    pthread_atfork(NULL, NULL, child_after_fork);
}

static void run_chunks(void) {
    int64_t chunks = (pool.n + CHUNK - 1) / CHUNK;
    for (;;) {
        int64_t c = __atomic_fetch_add(&pool.next, 1, __ATOMIC_RELAXED);
        if (c >= chunks) return;
        int64_t lo = c * CHUNK, hi = lo + CHUNK < pool.n ? lo + CHUNK : pool.n;
        adam_range(pool.bf16, pool.p, pool.g, pool.m, pool.v, lo, hi, &pool.h);
    }
}

static void *pool_thread(void *arg) {
    int index = (int)(intptr_t)arg;
    if (index < pool.ncores) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(pool.cores[index], &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    int64_t seen = 0;
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        while (pool.generation == seen) pthread_cond_wait(&pool.start, &pool.mu);
        seen = pool.generation;
        int takes_part = index < pool.want;
        pthread_mutex_unlock(&pool.mu);
        if (takes_part) run_chunks();
        pthread_mutex_lock(&pool.mu);
        if (takes_part && ++pool.finished == pool.want) pthread_cond_signal(&pool.done);
    }
    return NULL;
}

/* Pin the pool's threads made from now on to these cores, one each (ZERORUN_CPU_PIN). */
void zerorun_pool_pin(const int *cores, int ncores) {
    pthread_mutex_lock(&pool.mu);
    pool.ncores = ncores < MAX_THREADS ? ncores : MAX_THREADS;
    for (int i = 0; i < pool.ncores; ++i) pool.cores[i] = cores[i];
    pthread_mutex_unlock(&pool.mu);
}

/* A thread that cannot be made is simply not there: the caller and the others take its chunks. */
void zerorun_adam_pool(int bf16, void *p, const void *g, void *m, void *v, int64_t n,
                      float one_minus_beta1, float beta2, float one_minus_beta2, float eps,
                      float weight_decay, float decay, int mode, int maximize, float step_size,
                      float bias_correction2_sqrt, int threads) {
    pthread_mutex_lock(&pool.call);
    pthread_mutex_lock(&pool.mu);
    int helpers = threads - 1 < MAX_THREADS ? threads - 1 : MAX_THREADS;
    while (pool.size < helpers) {
        pthread_t t;
        if (pthread_create(&t, NULL, pool_thread, (void *)(intptr_t)pool.size) != 0) break;
        pthread_detach(t);
        pool.size++;
    }
    if (helpers > pool.size) helpers = pool.size;
    pool.bf16 = bf16; pool.p = p; pool.g = g; pool.m = m; pool.v = v; pool.n = n;
    fill_hyper(&pool.h, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay, mode,
               maximize, step_size, bias_correction2_sqrt);
    pool.next = 0;
    pool.want = helpers;
    pool.finished = 0;
    pool.generation++;
    pthread_cond_broadcast(&pool.start);
    pthread_mutex_unlock(&pool.mu);
    run_chunks();
    pthread_mutex_lock(&pool.mu);
    while (pool.finished < pool.want) pthread_cond_wait(&pool.done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.call);
}
"""

_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-pthread", "-shared", "-fPIC"]
_MIN_SPLIT = 1 << 16  # elements: below this one thread does the whole call
_lock = threading.Lock()


class AdamKernel:
    """The built kernel: ``step(...)`` updates one tile (fp32 master, m, v; bf16 or fp32 gradient)."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        f, i64, i32, ptr = ctypes.c_float, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        args: list[Any] = [i32, ptr, ptr, ptr, ptr, i64, f, f, f, f, f, f, i32, i32, f, f, i32]
        self._omp, self._pool = lib.zerorun_adam_omp, lib.zerorun_adam_pool
        for fn in (self._omp, self._pool):
            fn.argtypes, fn.restype = args, None
        # How the elements are split across cores: "threads" (the default) -- zerorun's pool of
        # C threads, chunks claimed dynamically; "omp" -- one OpenMP region per call, a static
        # split (the team belongs to the calling thread). ZERORUN_CPU_KERNEL=omp|threads.
        mode = os.environ.get("ZERORUN_CPU_KERNEL", "threads")
        self.mode = mode if mode in ("omp", "threads") else "threads"
        cores = pool_cores(cores_per_rank() - 1)
        if cores:
            lib.zerorun_pool_pin((ctypes.c_int * len(cores))(*cores), len(cores))
        self.pinned = cores

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
        if g.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"adam kernel: the gradient must be bfloat16 or float32, got {g.dtype}")
        for t, dtype in ((p, torch.float32), (g, g.dtype), (exp_avg, torch.float32), (exp_avg_sq, torch.float32)):
            if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n:
                raise ValueError(f"adam kernel: expected a contiguous CPU {dtype} tensor of {n} elements, got {t.dtype} {tuple(t.shape)}")
        # The bias corrections in double, as torch's kernel computes them.
        bias_correction1 = 1.0 - beta1**step
        bias_correction2_sqrt = (1.0 - beta2**step) ** 0.5
        threads = max(1, threads) if n >= _MIN_SPLIT else 1
        # ctypes releases the GIL for the call: one release and one re-acquire per tile, however
        # many threads share it (a Python pool needed a few per thread, each waiting for a busy
        # training thread to yield the GIL: 19x slower on the H200, host_pages_ab "busy").
        (self._omp if self.mode == "omp" else self._pool)(
            1 if g.dtype == torch.bfloat16 else 0,
            p.data_ptr(),
            g.data_ptr(),
            exp_avg.data_ptr(),
            exp_avg_sq.data_ptr(),
            n,
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
            threads,
        )


def pool_cores(size: int) -> list[int] | None:
    """The cores the pool's ``size`` threads are pinned to, one each (``ZERORUN_CPU_PIN``, on
    unless ``0``): the last ``size`` of the cores this rank may use, so the first stays with the
    threads that are not pinned (the training thread; the caller, which works on the tile too,
    floats). On the H200 host the pinned pool stepped 5.2 G elements/s against 4.2 free, and
    the 1.3B exact offload rows went from 0.71x to 0.90x (benchmarks/results/gpu_runs/
    20261202T0050Z-h200-086ac92) -- presumably because free threads migrate onto the core the
    training thread needs, and a chunk's cache lines with them (not measured).

    The cores this rank may use are ``options.rank_cores``: its own affinity, or, where the
    ranks of a node share the node's cores (zerorun's launcher), its slice of them, so that two
    ranks' pools never share a core. None when pinning is off, or when the rank has no core to
    spare for the threads that are not pinned."""
    if os.environ.get("ZERORUN_CPU_PIN", "1") == "0" or size < 1:
        return None
    cores = rank_cores()
    return cores[-size:] if len(cores) > size else None


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
