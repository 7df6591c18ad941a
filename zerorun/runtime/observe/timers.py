"""Wall-clock breakdown of a training step (`wall_clock_breakdown`): forward, backward, the
backward's exposed communication, optimizer step.

On CUDA each phase is a pair of CUDA events recorded on the current stream: recording costs no
host synchronisation, so timing does not change what it measures. The elapsed times are read
only in `collect()`, called at the `steps_per_print` step -- that is the one sync point (it
waits for the last recorded event). On the CPU the work is synchronous and `time.perf_counter`
is exact.

Phase names are DeepSpeed's global timers: `fwd`, `bwd` (= `bwd_inner` + `bwd_allreduce`),
`bwd_inner` (autograd), `bwd_allreduce` (waiting for the gradient collectives still in flight
when autograd finished: the communication the backward did not hide), `step` (grad norm,
clipping, optimizer step on the shards, write-back/all-gather, offload's CPU step), and inside
`step` DeepSpeed's ZeRO timers `optimizer_gradients` (global norm, fp16 overflow check, unscale
and clip) and `optimizer_step` (the shards' optimizer step with the write-back / all-gather and,
with offload, the gradient copies to the host, the CPU optimizer and the parameter copies back).

Offload's sub-phases (`OFFLOAD_PHASES`, reported only when an offload placement ran) come from
the placement (`ShardPlacement.phase_timer`, a *source* polled at `end_step`), because they run
on other streams and threads and overlap the phases above (a CPU step started during the
backward; the delayed update's during the next forward): `offload_d2h` / `offload_h2d` the
gradient copies down and the parameter copies up (CUDA events on the copy streams: the copy
engines' busy time), `offload_cpu_step` the CPU optimizer on the worker (+ staging),
`offload_grad_wait` the worker waiting for gradient copies, `offload_io_wait` waiting for NVMe
reads, `offload_step_wait` the training thread blocked on the CPU step (what the step exposes),
`offload_param_fetch` stage 3's parameter copies up from the host (`offload_param`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["PHASES", "OFFLOAD_PHASES", "PhaseTimers", "PhaseSource", "PhaseValue", "Mark", "Stamp"]

PHASES = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step", "optimizer_gradients", "optimizer_step")
OFFLOAD_PHASES = (
    "offload_d2h",
    "offload_cpu_step",
    "offload_h2d",
    "offload_grad_wait",
    "offload_io_wait",
    "offload_step_wait",
    "offload_param_fetch",
)
# Sub-phases measured elsewhere: name -> milliseconds (a float) or (begin, end) marks (CUDA
# events, or perf_counter seconds) of the step just ended; a source returns them per step.
Stamp = float | torch.cuda.Event
Mark = tuple[Stamp, Stamp]
PhaseValue = float | list[Mark]
PhaseSource = Callable[[], Mapping[str, PhaseValue]]


class PhaseTimers:
    """Accumulates (start, end) marks per phase; `end_step()` closes one optimizer step;
    `collect()` -> milliseconds per phase for every closed step since the last collect."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._open: dict[str, Any] = {}
        self._current: dict[str, list[float | Mark]] = {}
        self._closed: list[dict[str, list[float | Mark]]] = []
        self.sources: list[PhaseSource] = []  # polled at end_step (offload's sub-phases)

    def _mark(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()  # on the current stream; no host sync
            return event
        return time.perf_counter()

    def start(self, name: str) -> None:
        self._open[name] = self._mark()

    def stop(self, name: str) -> None:
        begin = self._open.pop(name, None)
        if begin is not None:
            self._current.setdefault(name, []).append((begin, self._mark()))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def add(self, name: str, value: PhaseValue) -> None:
        """Time measured elsewhere for this step: milliseconds, or (begin, end) marks."""
        self._current.setdefault(name, []).extend(value if isinstance(value, list) else [float(value)])

    def end_step(self) -> None:
        for source in self.sources:
            for name, value in source().items():
                self.add(name, value)
        self._closed.append(self._current)
        self._current = {}

    def pending_steps(self) -> int:
        return len(self._closed)

    def collect(self) -> list[dict[str, float]]:
        """Milliseconds per phase, one dict per closed step (phases that did not run: 0; the
        offload phases only when some step since the last collect had them). On CUDA this
        waits for the last recorded event: call it only at a print step."""
        extra = [n for n in OFFLOAD_PHASES if any(n in step for step in self._closed)]
        out = []
        for step in self._closed:
            row = {}
            for name in (*PHASES, *extra):
                total = 0.0
                for item in step.get(name, ()):
                    if isinstance(item, float):
                        total += item
                        continue
                    begin, end = item
                    if isinstance(begin, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
                        end.synchronize()  # host sync: only here, at the print step
                        total += float(begin.elapsed_time(end))
                    elif isinstance(begin, float) and isinstance(end, float):
                        total += (end - begin) * 1000.0
                row[name] = total
            out.append(row)
        self._closed = []
        return out
