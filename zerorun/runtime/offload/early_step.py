"""``EarlyStep``: what ``HostPlacement`` (host_placement.py) starts during the backward, from
the stage's ``grad_ready`` hook, so that the CPU and the copies work while the GPU finishes the
backward: the exact optimizer step started early, with the write-backs it leaves in flight when
``step`` returns (the next forward completes them), and the delayed update's copies (dpu.py).

    grad_ready(i)     no clipping, no fp16 check: copy gradient shard i down and queue its CPU
                      update (_enqueue); the worker takes, of the queued buffers whose gradient
                      is on the host, the best priority (_early_next, pick_next)
    step()            _finish_early: queue the buffers that had no hook, step the Twin-Flow part
                      on the device, copy each buffer up once the worker stepped it -- except the
                      stage's ``deferrable`` ones (from the second step on): their write-backs
                      stay in flight (_deferred), each issued right after its update (by the
                      worker; by _finish_early for those the worker stepped during the backward)
    settle(i)         the next forward's first use of buffer i, or a reader (stage 3's host store:
                      ``before_read``): wait until its copy up was issued, then until it landed
                      (host shard) or order the caller's stream after it (device destination)
    _flush_deferred   every deferred write-back, before anything else touches masters or shards
    _window_copy      a delayed update running instead (dpu.py): grad_ready hands buffer i to
                      its copy window, which copies each tile (gradient down, update up) once
                      the worker stepped it; _close_window ends it (the next grad_for_step)

Apart from host_placement.py because this is where the training thread and the worker hand
flat buffers to each other in the middle of a step: ``_queue``, ``_deferred``, ``_unpushed`` and
``_failed`` under ``_sched``, one ``threading.Event`` per buffer in ``_stepped`` (its update done)
and in ``_deferred`` (its copy up issued). The class holds no state of its own:
``HostPlacement.__init__`` creates every attribute used here (declared below, annotations only,
for mypy), and the methods of ``HostPlacement`` it calls are declared for type checking only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from zerorun.runtime.offload.adam import supports_tiles
from zerorun.runtime.offload.host import Copier
from zerorun.runtime.offload.twinflow import ready_order
from zerorun.runtime.sharded_state import ShardPlacement

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch
    from torch.optim import Optimizer

    from zerorun.runtime.offload.dpu import CopyWindow, DelayPolicy
    from zerorun.runtime.offload.host_placement import Event, StepJob
    from zerorun.runtime.offload.options import OffloadOptions
    from zerorun.runtime.offload.runner import StepRunner
    from zerorun.runtime.offload.step_profile import StepProfile

__all__ = ["EarlyStep", "pick_next"]


class EarlyStep(ShardPlacement):
    """The early step and its deferred write-backs: the base of ``HostPlacement`` only."""

    # Set by HostPlacement (its __init__, or class attributes), documented there.
    opts: OffloadOptions
    copier: Copier
    runner: StepRunner
    delay: DelayPolicy
    stage_on_host: bool
    masters: list[torch.Tensor]
    wire: list[torch.Tensor]
    tiles: list[list[tuple[int, int]]]
    on_device: list[bool]
    steps: int
    early_steps: int
    profile: StepProfile
    _host: list[int]
    _targets: dict[int, torch.Tensor]
    _grad_ev: list[list[Event]]
    _up_ev: list[list[Event]]
    _fresh: list[bool]
    _ready: Event
    _last_down: Event
    _last_up: Event
    _in_step: bool
    _early: StepJob | None
    _early_work: list[tuple[int, Future[None]]]
    _sched: threading.Lock
    _queue: list[tuple[tuple[int, int], int, int]]
    _seq: int
    _stepped: dict[int, threading.Event]
    _worker_error: BaseException | None
    _deferred: dict[int, threading.Event]
    _unpushed: set[int]
    _failed: set[int]
    _deferred_after: Event
    _window: CopyWindow | None
    _copied: set[int]
    overlapped_buffers: int

    if TYPE_CHECKING:  # HostPlacement's (no definitions at run time)

        def _prepare(self, optimizer: Optimizer, tiled: bool) -> StepJob: ...

        def _update(
            self, job: StepJob, *, push: bool, indices: list[int] | None = None, window: CopyWindow | None = None
        ) -> None: ...

        def _step_device(self, job: StepJob) -> None: ...

        def _copy_down(self, index: int, grad_shard: torch.Tensor) -> None: ...

        def _push(self, index: int, dst: torch.Tensor, after: Event = None, *, deferred: bool = False) -> None: ...

        def _source(self, index: int) -> torch.Tensor: ...

        def _close_profile(self) -> None: ...

    # -- the step started during the backward, its deferred write-backs ------------------------
    def grad_ready(self, index: int, grad_shard: torch.Tensor, optimizer: Optimizer | None) -> None:
        """During backward (the stage's reduction hook): with no clipping and no fp16 check the
        step of a flat buffer needs nothing but its own gradient, so copy it down and queue its
        CPU step now; the CPU then works while the GPU finishes the backward. (With clipping the
        step must wait for the global norm: grad_for_step.)"""
        if not self.opts.early_start or optimizer is None or not supports_tiles(optimizer):
            return
        if self.on_device[index]:
            return  # Twin-Flow: stepped on the device after the backward
        if self._early is None:
            if self.delay.delayed(self.steps, tiled=True, optimizer_name=type(optimizer).__name__):
                # The delayed step runs after write_back; its copies may go now (dpu.CopyWindow).
                window = self._window
                if window is not None:
                    window.grad_ready(index, (self.copier.ready(), grad_shard))
                return
            self.runner.join()
            self._flush_deferred()
            self._in_step = True
            self._early = self._prepare(optimizer, True)
            self._early_work = []
            self._stepped = {}
            self._unpushed = set()
            self._failed = set()
        if index in self._stepped:
            return
        self._ready = self.copier.ready()  # after the reduction, on the stream that waited for it
        self._copy_down(index, grad_shard)
        self._enqueue(index, self._early)

    def _enqueue(self, index: int, job: StepJob) -> None:
        """Queue flat buffer ``index``'s early CPU update: the worker runs one job per buffer
        queued, each taking the queued buffer of best priority (_priority)."""
        self._stepped[index] = threading.Event()
        with self._sched:
            self._queue.append((self._priority(index), self._seq, index))
            self._seq += 1
        future = self.runner.submit(lambda: self._early_next(job), queue=True)
        self._early_work.append((index, future))

    def _priority(self, index: int) -> tuple[int, int]:
        """Buffers the step must finish before it returns first; then those whose write-back
        may finish later (_deferrable) in the order the next forward uses them (``settle_order``
        when the stage gives one, else the reverse of the order their gradients became final),
        so it can start on the first while the CPU steps the rest."""
        if not self._deferrable(index):
            return (0, 0)
        if index in self.settle_order:  # (the stage's own order: stage 3's persistent group first)
            return (1, self.settle_order.index(index))
        order = ready_order(len(self.masters), self.opts.stage)
        return (1, len(order) + len(order) - 1 - order.index(index))

    @property
    def may_defer(self) -> bool:
        """Can a step leave write-backs in flight (``deferrable``)? When it starts in the
        backward (no clipping, no fp16 check) and the copies up read the masters themselves
        (CPU memory; NVMe's staging buffers are reused)."""
        return self.opts.early_start and not self.stage_on_host

    def _deferrable(self, index: int) -> bool:
        """May this buffer's write-back complete after step() returns? Only where the stage
        settles it before anything reads the destination (``deferrable``: stages 1-2 at the
        first forward module that uses the buffer, stage 3 at its group's fetch or forward),
        once the destination is known (from the second step on)."""
        return self.may_defer and index in self.deferrable and index in self._targets

    def in_flight(self) -> frozenset[int]:
        return frozenset(self._deferred)

    def _early_next(self, job: StepJob) -> None:
        """Worker: the early CPU update of the queued buffer of best priority; a deferred
        write-back is issued right after it (the forward may be waiting for it)."""
        with self._sched:
            entry = pick_next(self._queue, self._arrived)
            self._queue.remove(entry)
            index = entry[2]
        issued: threading.Event | None = None
        try:
            self._update(job, push=False, indices=[index])
            with self._sched:
                issued = self._deferred.get(index)
                if issued is None and self._deferrable(index):
                    self._unpushed.add(index)  # _finish_early copies it
            if issued is not None:
                self._push(index, self._targets[index], after=self._deferred_after, deferred=True)
        except BaseException as e:
            self._worker_error = e
            with self._sched:
                # No write-back comes for it: its settle() must raise the error, not wait.
                self._failed.add(index)
                issued = self._deferred.get(index)
            raise
        finally:
            self._stepped[index].set()
            if issued is not None:
                issued.set()

    def _arrived(self, index: int) -> bool:
        """Are buffer ``index``'s gradient tiles on the host (its copies done; no wait)?"""
        return all(ev is None or ev.query() for ev in self._grad_ev[index])

    def _wait_stepped(self, index: int) -> None:
        self._stepped[index].wait()
        if self._worker_error is not None:
            error, self._worker_error = self._worker_error, None
            self.runner.join()  # raises the worker's exception with its traceback
            raise error

    def _finish_early(self) -> None:
        """The backward is over: queue what had no hook, then copy each flat buffer up as soon
        as its CPU step is done (overlapping the CPU work still running on later ones). Stage 3
        parameter offload: the host shards' write-backs are left to the next forward's fetches
        (settle), which then starts while the CPU steps the rest."""
        job, self._early = self._early, None
        assert job is not None
        self.steps += 1
        self.early_steps += 1
        for i in self._host:
            if i not in self._stepped:
                self._enqueue(i, job)  # no reduction hook for this one (copied down by grad_for_step)
        self._step_device(job)  # concurrently with the host part still running on the worker
        self._ready = self.copier.ready()  # parameters may be written once the backward is done
        later = [i for i in self._host if self._deferrable(i)]
        deferred = set(later)
        if later:
            self._deferred_after = self._ready
            with self._sched:
                self._deferred = {i: threading.Event() for i in later}
                stepped, self._unpushed = [i for i in later if i in self._unpushed], set()
                for i in later:
                    if i in self._failed:  # its update raised: settle() raises, not waits
                        self._deferred[i].set()
            # Stepped during the backward: copy them now, in forward order.
            for i in sorted(stepped, key=self._priority):
                self._push(i, self._targets[i], after=self._deferred_after, deferred=True)
                self._deferred[i].set()
            if self.param_store is not None and hasattr(self.param_store, "before_read"):
                self.param_store.before_read = self.settle  # type: ignore[attr-defined]
        # In the order they were queued, which is about the order the worker finishes them
        # (pick_next), so each is copied up while the CPU steps later ones.
        for i in [i for i, _ in self._early_work if i not in deferred]:
            self._wait_stepped(i)
            target = self._targets.get(i)
            if target is not None and self._fresh[i]:
                self._push(i, target)
        self._early_work = []
        if not later:
            self.runner.join()

    def settle(self, index: int) -> None:
        """Flat buffer ``index``'s deferred write-back, complete (training thread: the stage
        calls it before the buffer's first use in the next forward and before any reader;
        stage 3's host store through ``before_read``): wait until its copy up was issued
        (after its CPU update), then -- a host shard -- until it landed, or -- a device
        destination -- order the caller's stream after it (no host sync)."""
        issued = self._deferred.get(index)
        if issued is None:
            return
        t0 = time.perf_counter()
        issued.wait()
        if self._worker_error is not None:
            self._wait_stepped(index)  # raises the worker's error
        with self._sched:
            del self._deferred[index]
        target = self._targets.get(index)
        if target is not None and target.device.type != "cpu":
            self.copier.fence(self._up_ev[index][-1])  # one stream: the last tile's covers all
        else:
            Copier.wait(self._up_ev[index][-1])
        # The caller (the next forward, a reader) blocked on this step's CPU work: apart from
        # main_wait_s (blocked in step()), so that stages are compared on the sum (StepProfile).
        self.profile.add("settle_wait_s", time.perf_counter() - t0)
        if not self._deferred:
            self._deferred_after = None
            if self.profile.pending:
                self._close_profile()

    def _flush_deferred(self) -> None:
        """Every deferred write-back done (before anything else touches masters or shards)."""
        for index in sorted(self._deferred, key=self._priority):
            self.settle(index)

    def settle_all(self) -> None:
        self._flush_deferred()

    # -- the delayed update's copies during the backward (dpu.CopyWindow) ----------------------
    def _close_window(self) -> None:
        """The delayed update is joined: the overlapping copies end (dpu.CopyWindow)."""
        window, self._window = self._window, None
        if window is not None:
            self._copied = window.close()
            self.overlapped_buffers += len(self._copied)

    def _window_copy(self, index: int, k: int, ready: tuple[Event, torch.Tensor]) -> None:
        """Tile ``k`` of buffer ``index`` during the backward (dpu.CopyWindow, on the copy
        thread): its gradient down, the delayed update up into the device parameter shard, both
        after ``ready`` (the training stream at the buffer's grad_ready)."""
        event, grad_shard = ready
        a, b = self.tiles[index][k]
        src = grad_shard.reshape(-1)
        self._grad_ev[index][k] = self._last_down = self.copier.to_host(
            self.wire[index][a:b], src[a:b], event
        )
        target = self._targets.get(index)
        if self.param_store is None and target is not None:  # (stage 3 host shards: at the step)
            flat = target.reshape(-1)
            self._up_ev[index][k] = self._last_up = self.copier.to_device(
                flat[a:b], self._source(index)[a:b], event
            )
            if k == len(self.tiles[index]) - 1:
                self._fresh[index] = False


def pick_next(
    queue: Sequence[tuple[tuple[int, int], int, int]], arrived: Callable[[int], bool]
) -> tuple[tuple[int, int], int, int]:
    """The worker's next early buffer from ``(priority, sequence, index)`` entries: of those
    whose gradient is already on the host, the best priority (then the first queued); if none
    has arrived, the first queued -- its gradient comes first, since the training thread queues
    the buffers (and their copies) in the order the GPU reduces them, far ahead of the GPU.
    (Choosing by priority among all queued buffers made the worker wait for the buffer the GPU
    reduces last: on the H200, stage 3 waited 0.195 s for gradients instead of 0.073 s.)"""
    ready = [e for e in queue if arrived(e[2])]
    return min(ready) if ready else min(queue, key=lambda e: e[1])
