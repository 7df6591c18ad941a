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
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["PHASES", "PhaseTimers"]

PHASES = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step", "optimizer_gradients", "optimizer_step")


class PhaseTimers:
    """Accumulates (start, end) marks per phase; `end_step()` closes one optimizer step;
    `collect()` -> milliseconds per phase for every closed step since the last collect."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._open: dict[str, Any] = {}
        self._current: dict[str, list[tuple[Any, Any]]] = {}
        self._closed: list[dict[str, list[tuple[Any, Any]]]] = []

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

    def end_step(self) -> None:
        self._closed.append(self._current)
        self._current = {}

    def pending_steps(self) -> int:
        return len(self._closed)

    def collect(self) -> list[dict[str, float]]:
        """Milliseconds per phase, one dict per closed step (phases that did not run: 0).
        On CUDA this waits for the last recorded event: call it only at a print step."""
        out = []
        for step in self._closed:
            row = {}
            for name in PHASES:
                total = 0.0
                for begin, end in step.get(name, ()):
                    if self._cuda:
                        end.synchronize()  # host sync: only here, at the print step
                        total += float(begin.elapsed_time(end))
                    else:
                        total += (end - begin) * 1000.0
                row[name] = total
            out.append(row)
        self._closed = []
        return out
