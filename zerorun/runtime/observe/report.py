"""Progress reports: what the engine tells people and dashboards about each optimizer step.

Every optimizer step is recorded with device tensors (loss, grad norm) and host numbers (lr,
loss scale, samples, tokens) -- no host sync. Every `steps_per_print` steps the record is read
in one go (one sync: a stack + `tolist`, and the CUDA timer events) and reported:

* rank 0 prints DeepSpeed-style lines on stdout (the launcher prefixes and logs them):
  `[Rank 0] step=10, skipped=0, lr=[0.001], mom=[(0.9, 0.999)], loss=..., ...` and, with
  `wall_clock_breakdown`, `[Rank 0] time (ms) | fwd: ... | bwd: ... | ... | step: ...`
  (mean per optimizer step over the interval);
* every rank sends a `status` event (Contract 3) with the same numbers and its own timers, so
  the launcher's live panel shows a straggler;
* rank 0's monitors get one event per step and tag (monitors.py).

Between print steps a light `status` event (step, loss, lr) keeps the live panel moving, at
most once a second, without a host sync on CUDA: its loss is copied to pinned host memory
(non-blocking, with an event) and read at the next light status, so the panel's loss is that
of the previous light status, about a second old (`_LossReadback`). On CPU it is read directly.

A `steps_per_print` longer than `MAX_PENDING` steps (DeepSpeed configs set 2000, or 1e9 to
silence the prints) does not hold every step's device tensors and CUDA events until the print:
every `MAX_PENDING` steps they are read (one host sync) and written to the monitors, without a
print or an event.
"""

from __future__ import annotations

import atexit
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from zerorun.channel import events
from zerorun.runtime.activations import take_profile as take_checkpoint_profile
from zerorun.runtime.observe.flops import FlopsProfiler
from zerorun.runtime.observe.monitors import Event, MonitorSet
from zerorun.runtime.observe.options import ObserveOptions
from zerorun.runtime.observe.timers import OFFLOAD_PHASES, PhaseTimers

__all__ = ["StepReporter", "StepRecord", "count_tokens", "TIMER_TAGS", "MAX_PENDING"]

MAX_PENDING = 1000  # steps recorded on the device at most between two reads (module docstring)

# DeepSpeed's monitor tags for the timers.
TIMER_TAGS = {
    "fwd": "Train/Samples/elapsed_time_ms_forward",
    "bwd": "Train/Samples/elapsed_time_ms_backward",
    "bwd_inner": "Train/Samples/elapsed_time_ms_backward_inner",
    "bwd_allreduce": "Train/Samples/elapsed_time_ms_backward_allreduce",
    "step": "Train/Samples/elapsed_time_ms_step",
}


def count_tokens(args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """Tokens in one forward's inputs: the `input_ids` keyword, or else the first positional
    argument, when it is an integer tensor of at least 2 dimensions (batch x sequence). 0 when
    the inputs are not token ids (the report then leaves tokens/s out)."""
    candidate = kwargs.get("input_ids")
    if candidate is None and args:
        candidate = args[0]
        if isinstance(candidate, Mapping):  # a batch dict passed positionally
            candidate = candidate.get("input_ids")
    if torch.is_tensor(candidate) and candidate.dim() >= 2 and not candidate.is_floating_point():
        return int(candidate.numel())
    return 0


def _read_scalars(records: Sequence[StepRecord]) -> tuple[list[float | None], list[float | None]]:
    """Every record's loss and grad norm as floats: the one host sync of a report."""
    tensors = [t.reshape(()).float() for r in records for t in (r.loss, r.grad_norm) if t is not None]
    values = iter(torch.stack(tensors).tolist() if tensors else [])
    losses: list[float | None] = []
    norms: list[float | None] = []
    for r in records:
        losses.append(next(values) if r.loss is not None else None)
        norms.append(next(values) if r.grad_norm is not None else None)
    return losses, norms


class _LossReadback:
    """The light status's loss without a host sync (module docstring). On CUDA, `read(loss)`
    returns the value copied at an earlier call once its event has completed (None until then)
    and starts the copy of `loss` -- like checkpoint/autosave.py's preemption flag. On CPU, the
    value of `loss` itself."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._host: torch.Tensor | None = None
        self._event: Any = None
        self._pending = False
        self.value: float | None = None

    def read(self, loss: torch.Tensor | None) -> float | None:
        if not self._cuda:
            return None if loss is None else float(loss.item())
        if self._pending and self._event.query():  # query(): never waits
            self.value = float(self._host.item())  # type: ignore[union-attr]  # host memory: no sync
            self._pending = False
        if not self._pending and loss is not None:
            if self._host is None:
                self._host = torch.empty((), dtype=torch.float32, pin_memory=True)
                self._event = torch.cuda.Event()
            self._host.copy_(loss.detach().reshape(()), non_blocking=True)
            self._event.record()
            self._pending = True
        return self.value


@dataclass
class StepRecord:
    step: int
    samples: int
    loss: torch.Tensor | None
    grad_norm: torch.Tensor | None
    lrs: list[float]
    loss_scale: float
    skipped: int
    gpu_allocated: int | None
    gpu_max_allocated: int | None


class StepReporter:
    def __init__(
        self,
        options: ObserveOptions,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        fp16: bool,
        module: torch.nn.Module | None = None,
        compute_dtype: torch.dtype = torch.float32,
        micro_batch: int = 1,
        stdout: Any = None,
    ) -> None:
        self.options = options
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.fp16 = fp16
        self._out = stdout
        self.timers = PhaseTimers(device) if options.wall_clock_breakdown else None
        self.monitors = MonitorSet(options.monitors, rank=rank)
        self._loss_sum: torch.Tensor | None = None
        self._micro = 0
        self._tokens = 0  # this rank's tokens since the last print
        self._records: list[StepRecord] = []
        self._last_print = time.perf_counter()
        self._samples_at_print = 0
        self._last_light = time.monotonic()
        self._light_loss = _LossReadback(device)
        self.last_report: dict[str, Any] | None = None
        self._micro_in_step = 0
        self.profiler: FlopsProfiler | None = None
        if options.flops_profiler.enabled and module is not None:
            self.profiler = FlopsProfiler(
                options.flops_profiler,
                module,
                rank=rank,
                world_size=world_size,
                device=device,
                compute_dtype=compute_dtype,
                micro_batch=micro_batch,
                write=self._write_profile,
            )
            self.profiler.maybe_start(0)
        if self.monitors.enabled:
            atexit.register(self.close)  # the steps after the last print step reach the files too

    def phase(self, name: str) -> AbstractContextManager[None]:
        """One phase of the step: timed with `wall_clock_breakdown` (timers.py), counted by the
        FLOPs profiler during its step (flops.py); otherwise nothing."""
        if self.profiler is not None and self.profiler.active:
            return self._profiled_phase(name)
        return self.timers.phase(name) if self.timers is not None else nullcontext()

    @contextmanager
    def _profiled_phase(self, name: str) -> Iterator[None]:
        assert self.profiler is not None
        self.profiler.enter_phase(name)
        try:
            with self.timers.phase(name) if self.timers is not None else nullcontext():
                yield
        finally:
            self.profiler.exit_phase(name)

    def _write_profile(self, text: str) -> None:
        path = self.options.flops_profiler.output_file
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(text)
        else:
            out = self._out or sys.stdout
            out.write(text)
            out.flush()

    # -- per micro-step ---------------------------------------------------------------------
    def on_forward(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        if torch.is_grad_enabled():
            self._tokens += count_tokens(args, kwargs)

    def on_backward(self, loss: torch.Tensor) -> None:
        value = loss.detach().float()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._micro += 1
        self._micro_in_step += 1

    # -- per optimizer step -----------------------------------------------------------------
    def after_step(
        self,
        *,
        step: int,
        samples: int,
        skipped: int,
        lrs: list[float],
        moms: list[Any],
        loss_scale: float,
        grad_norm: torch.Tensor | None,
    ) -> None:
        loss = None if self._loss_sum is None else self._loss_sum / max(self._micro, 1)
        self._loss_sum, self._micro = None, 0
        allocated = max_allocated = None
        if self.device.type == "cuda":
            # Host-side counters of the caching allocator: no device sync.
            allocated = torch.cuda.memory_allocated(self.device)
            max_allocated = torch.cuda.max_memory_allocated(self.device)
        self._records.append(
            StepRecord(step, samples, loss, grad_norm, lrs, loss_scale, skipped, allocated, max_allocated)
        )
        if self.timers is not None:
            self.timers.end_step()
        if self.profiler is not None:
            self.profiler.after_step(step, self._micro_in_step)
            self.profiler.maybe_start(step)
        self._micro_in_step = 0
        if step % self.options.steps_per_print == 0:
            self._report(moms)
        elif len(self._records) >= MAX_PENDING:
            self._report(moms, show=False)
        else:
            self._light_status(step, loss, lrs)

    def _light_status(self, step: int, loss: torch.Tensor | None, lrs: list[float]) -> None:
        now = time.monotonic()
        if now - self._last_light < 1.0:
            return
        if not events.connected():
            return
        self._last_light = now
        value = self._light_loss.read(loss)  # CUDA: the previous light status's loss, no host sync
        extra = {}
        if self.last_report is not None:  # the panel keeps the last report's throughput and timers
            for key in ("tokens_per_sec", "samples_per_sec", "timers_ms"):
                if self.last_report.get(key) is not None:
                    extra[key] = self.last_report[key]
        events.emit("status", step=step, loss=value, lr=lrs[0] if lrs else None, **extra)

    def _report(self, moms: list[Any], *, show: bool = True) -> None:
        """Read the steps since the last report (the one host sync) and write them to the
        monitors; with `show`, also the stdout line (rank 0) and the status event."""
        records, self._records = self._records, []
        losses, norms = _read_scalars(records)
        timers = self.timers.collect() if self.timers is not None else []
        last = records[-1]
        samples_per_sec, tokens_per_sec = self._throughput(last.samples)
        self._last_print, self._samples_at_print, self._tokens = time.perf_counter(), last.samples, 0
        mean_timers = {
            name: sum(t.get(name, 0.0) for t in timers) / len(timers) for name in timers[-1]
        } if timers else None
        report: dict[str, Any] = {
            "step": last.step,
            "samples": last.samples,
            "skipped": last.skipped,
            "loss": losses[-1],
            "lr": last.lrs[0] if last.lrs else None,
            "lrs": last.lrs,
            "loss_scale": last.loss_scale,
            "grad_norm": norms[-1],
            "samples_per_sec": samples_per_sec,
            "tokens_per_sec": tokens_per_sec,
        }
        if mean_timers is not None:
            report["timers_ms"] = mean_timers
        if last.gpu_max_allocated is not None:
            report["gpu_max_allocated"] = last.gpu_max_allocated
        if show:
            checkpoints = take_checkpoint_profile()  # activation_checkpointing.profile; None when off
            if checkpoints is not None:
                report["checkpoint_profile"] = checkpoints
        self.last_report = report
        if show and self.rank == 0:
            self._print(report, moms)
        if show and events.connected():
            events.emit("status", **report)
        if self.monitors.enabled:
            self.monitors.write_events(self._monitor_events(records, losses, norms, timers, samples_per_sec, tokens_per_sec))

    def _throughput(self, samples: int) -> tuple[float, float | None]:
        elapsed = max(time.perf_counter() - self._last_print, 1e-9)
        # Every rank's forward sees a batch of the same shape in data-parallel training: this
        # rank's tokens x world size (no collective for a progress line).
        tokens = self._tokens * self.world_size / elapsed if self._tokens else None
        return (samples - self._samples_at_print) / elapsed, tokens

    def _monitor_events(
        self,
        records: list[StepRecord],
        losses: list[float | None],
        norms: list[float | None],
        timers: list[dict[str, float]],
        samples_per_sec: float,
        tokens_per_sec: float | None,
    ) -> list[Event]:
        out: list[Event] = []
        for i, r in enumerate(records):
            s = r.samples
            loss, norm = losses[i], norms[i]
            if loss is not None:
                out.append(("Train/Samples/train_loss", loss, s))
            if r.lrs:
                out.append(("Train/Samples/lr", r.lrs[0], s))
            if self.fp16:
                out.append(("Train/Samples/loss_scale", r.loss_scale, s))
            if norm is not None:
                out.append(("Train/Samples/grad_norm", norm, s))
            if i < len(timers):
                out.extend((tag, timers[i][name], s) for name, tag in TIMER_TAGS.items())
                out.extend(
                    (f"Train/Samples/elapsed_time_ms_{name}", timers[i][name], s)
                    for name in OFFLOAD_PHASES
                    if name in timers[i]
                )
            if r.gpu_allocated is not None:
                out.append(("Train/Samples/gpu_memory_allocated", float(r.gpu_allocated), s))
                out.append(("Train/Samples/gpu_memory_max_allocated", float(r.gpu_max_allocated or 0), s))
        # Throughput is measured over the interval: one point, at its last step.
        s = records[-1].samples
        out.append(("Train/Samples/samples_per_sec", samples_per_sec, s))
        if tokens_per_sec is not None:
            out.append(("Train/Samples/tokens_per_sec", tokens_per_sec, s))
        return out

    def _print(self, report: dict[str, Any], moms: list[Any]) -> None:
        out = self._out or sys.stdout
        lrs = "[" + ", ".join(f"{lr:.6g}" for lr in report["lrs"]) + "]"
        parts = [
            f"step={report['step']}",
            f"skipped={report['skipped']}",
            f"lr={lrs}",
            f"mom={moms}",
        ]
        if report["loss"] is not None:
            parts.append(f"loss={report['loss']:.6g}")
        if self.fp16:
            parts.append(f"loss_scale={report['loss_scale']:g}")
        if report["grad_norm"] is not None:
            parts.append(f"grad_norm={report['grad_norm']:.6g}")
        parts.append(f"samples/s={report['samples_per_sec']:.2f}")
        if report["tokens_per_sec"] is not None:
            parts.append(f"tokens/s={report['tokens_per_sec']:.0f}")
        lines = [f"[Rank 0] {', '.join(parts)}"]
        timers = report.get("timers_ms")
        if timers is not None:
            lines.append("[Rank 0] time (ms) | " + " | ".join(f"{k}: {v:.2f}" for k, v in timers.items()))
        ck = report.get("checkpoint_profile")
        if ck is not None:
            lines.append(
                f"[Rank 0] activation checkpointing (ms since the last report) | forward: {ck['forward_ms']:.2f} "
                f"({ck['forward_calls']:.0f} calls) | recompute: {ck['recompute_ms']:.2f} ({ck['recompute_calls']:.0f} calls)"
            )
        out.write("\n".join(lines) + "\n")
        out.flush()

    def flush(self) -> None:
        """Write the steps since the last print step to the monitors (no print, no event):
        at the end of training, so a dashboard has every step, as with DeepSpeed."""
        if not self._records or not self.monitors.enabled:
            return
        records, self._records = self._records, []
        losses, norms = _read_scalars(records)
        timers = self.timers.collect() if self.timers is not None else []
        samples_per_sec, tokens_per_sec = self._throughput(records[-1].samples)
        self.monitors.write_events(self._monitor_events(records, losses, norms, timers, samples_per_sec, tokens_per_sec))

    def close(self) -> None:
        """Flush and close the monitors (engine.destroy, or interpreter exit). Idempotent."""
        try:
            self.flush()
        finally:
            self.monitors.close()
