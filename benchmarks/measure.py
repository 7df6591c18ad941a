"""Measuring a configuration: the timed loop, device/host memory, and the derived rates.

Step time: the device is synchronised before and after every timed step (two host-device
sync points per step), so each sample is one whole step — forward, backward, optimizer,
communication — and nothing leaks into the next. Warm-up steps (allocator growth, kernel
selection, stage 3's first-step order recording) are excluded. The figure reported is the
median of the timed steps; the mean over the whole timed loop is kept as a cross-check.
"""

from __future__ import annotations

import gc
import resource
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from benchmarks.rankenv import synchronize

__all__ = [
    "Trainer",
    "Timing",
    "run_steps",
    "loss_curve",
    "profile_steps",
    "device_memory",
    "live_tensor_bytes",
    "host_rss_peak_bytes",
    "peak_bf16_flops",
    "throughput",
]


class Trainer(Protocol):
    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...
    def optimizer_step(self) -> None: ...
    def memory_report(self) -> dict[str, Any] | None: ...


@dataclass
class Timing:
    step_times_s: list[float]  # timed steps only
    losses: list[float]  # every step, warm-up included (this rank's micro-batch loss)
    loop_wall_s: float  # the whole timed loop, syncs included


def run_steps(
    trainer: Trainer,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    warmup: int,
    device: torch.device,
) -> Timing:
    """Run one step per batch; the first `warmup` are not timed."""
    losses: list[torch.Tensor] = []
    for x, y in batches[:warmup]:
        losses.append(trainer.forward_backward(x, y))
        trainer.optimizer_step()
    times: list[float] = []
    synchronize(device)
    loop_start = time.perf_counter()
    for x, y in batches[warmup:]:
        synchronize(device)
        t0 = time.perf_counter()
        losses.append(trainer.forward_backward(x, y))
        trainer.optimizer_step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    loop_wall = time.perf_counter() - loop_start
    # One transfer at the end instead of a .item() per step.
    values = torch.stack([loss.float().reshape(()) for loss in losses]).cpu().tolist()
    return Timing(step_times_s=times, losses=values, loop_wall_s=loop_wall)


def loss_curve(engine: Any, data: Any, steps: int, device: torch.device) -> tuple[list[float], list[float]]:
    """A convergence run's loop: `steps` training steps on `data.batch(i)`, the loss of each
    and the wall time of each. Unlike run_steps, the device is synchronised only every 10th
    step (a sync point per step would slow the run it measures); losses stay on the device
    until the end (one copy)."""
    losses, times = [], []
    for i in range(steps):
        x, y = data.batch(i)
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
        if device.type == "cuda" and (i % 10 == 9 or i == steps - 1):
            torch.cuda.synchronize()  # note: a CPU-GPU sync point, every 10 steps
        times.append(time.perf_counter() - t0)
    values = torch.stack([v.float().reshape(()) for v in losses]).cpu().tolist()
    return values, times


def profile_steps(
    trainer: Trainer,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    trace_path: str | None = None,
    row_limit: int = 25,
) -> str:
    """Run `batches` under torch.profiler (after the timed loop, so timing is unaffected) and
    return the top operators by self device time as text; optionally export a Chrome trace
    (large: keep it off machines that return few, small files)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for x, y in batches:
            trainer.forward_backward(x, y)
            trainer.optimizer_step()
        synchronize(device)
    if trace_path:
        prof.export_chrome_trace(trace_path)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=row_limit)


def device_memory(device: torch.device) -> dict[str, int | None]:
    """This process's GPU memory as the caching allocator counts it (None on CPU)."""
    if device.type != "cuda":
        return {"allocated": None, "reserved": None, "peak_allocated": None, "peak_reserved": None}
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak_allocated": torch.cuda.max_memory_allocated(device),
        "peak_reserved": torch.cuda.max_memory_reserved(device),
    }


def live_tensor_bytes(device: torch.device) -> int:
    """Bytes of the storages of every tensor Python can reach on `device`'s type, each storage
    once (a census of gc-tracked objects). On CPU, where there is no caching allocator to ask,
    this is the measured side of the memory check; on CUDA it is kept next to the allocator's
    figure (the difference is memory held where Python cannot see it, e.g. in C++ buffers)."""
    seen: set[int] = set()
    total = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated torch objects warns
        for obj in gc.get_objects():
            if not isinstance(obj, torch.Tensor) or obj.device.type != device.type:
                continue
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without storage
                continue
            ptr = storage.data_ptr()
            if ptr and ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
    return total


def host_rss_peak_bytes() -> int:
    """Peak resident set size of this process (Linux reports ru_maxrss in KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# Dense bf16 tensor-core peak, FLOP/s, by GPU name (vendor data sheets, SXM parts). The
# table's MFU uses this; --peak-tflops overrides it for other parts.
_PEAK_BF16 = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12))


def peak_bf16_flops(device_name: str | None) -> float | None:
    for key, peak in _PEAK_BF16:
        if device_name and key in device_name:
            return peak
    return None


def throughput(
    step_times_s: Sequence[float],
    *,
    tokens_per_step: int,
    world_size: int,
    flops_per_token: float,
    peak_flops_per_gpu: float | None,
) -> dict[str, float | None]:
    """Rates from the median step time. `tokens_per_step` counts every rank's tokens."""
    if not step_times_s:
        raise ValueError("no timed steps")
    median = statistics.median(step_times_s)
    tok_s = tokens_per_step / median
    tflops_gpu = tok_s * flops_per_token / world_size / 1e12
    return {
        "step_time_median_s": median,
        "step_time_mean_s": statistics.fmean(step_times_s),
        "step_time_min_s": min(step_times_s),
        "step_time_max_s": max(step_times_s),
        "tokens_per_s": tok_s,
        "tokens_per_s_per_gpu": tok_s / world_size,
        "tflops_per_gpu": tflops_gpu,
        "mfu": (tflops_gpu * 1e12 / peak_flops_per_gpu) if peak_flops_per_gpu else None,
    }
