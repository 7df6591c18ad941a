"""``HostPlacement``: fp32 masters and optimizer states on the host, the optimizer step on the CPU,
pipelined in tiles with the copies (Contract 6's ShardPlacement seam).

One optimizer step, exact mode (the engine has the global norm and has clipped/unscaled the
gradient shards on the device before ``ShardedOptimizerState.step``):

    grad_for_step(i)   queue D2H copies of gradient shard i, tile by tile      [side stream, async]
    step(optimizer)    on the worker thread, tile after tile:
                         wait for the tile's gradient copy -> Adam on the tile ->
                         queue its H2D copy into the parameter shard (fp32 master
                         tile up + cast on the GPU, or host staging)            [other side stream]
    write_back(i, dst) nothing left when the tile loop already wrote into ``dst``;
                       otherwise (first step: the destination is learned here) copy now
    after_write_back() the training stream waits for the last H2D copy (event wait, no host sync)

So the gradient copies overlap the step of earlier tiles and the parameter copies overlap the
step of later ones: the step costs about the CPU update alone. The destination of each shard
is remembered from ``write_back`` (stages keep it for the life of the engine); if it changes,
the new one gets a full copy. In delayed mode (dpu.py) the tile loop is launched in
``after_write_back`` and runs during the next forward/backward; each tile's copies (the next
gradient down, this update up) go once the worker stepped it and the next backward's
``grad_ready`` passed its buffer (dpu.CopyWindow), else at the end of the next step.

Host memory per rank (shard of N elements): fp32 master 4N, fp32 gradients 4N (pinned),
optimizer states (Adam 8N), and -- when ``stage_on_host`` -- staging in the parameter dtype
(pinned); reported in the memory summary under the device ``cpu``.

Twin-Flow (``offload_optimizer.ratio`` < 1, ``twinflow.py``): ``plan`` keeps the masters and
states of some flat buffers on the training device; those are stepped there by the same fused kernel on
the training thread, while the worker steps the host part (``_host``), and written back directly.

Subclasses decide where masters and states live (``CpuPlacement``: memory; ``NvmePlacement``:
files) through ``_new_master``, ``_state_tensor``, ``_tile_size`` and ``_tile_views``.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim import Optimizer

from zerorun.runtime.observe.timers import PhaseSource
from zerorun.runtime.offload.adam import AdamHyper, adam_tile, ensure_state, hyper_of, supports_tiles
from zerorun.runtime.offload.dpu import CopyWindow, DelayPolicy
from zerorun.runtime.offload.host import Copier, host_empty, tiles
from zerorun.runtime.offload.options import OffloadOptions
from zerorun.runtime.offload.runner import StepRunner
from zerorun.runtime.offload.step_profile import StepProfile
from zerorun.runtime.offload.twinflow import device_buffers, ready_order
from zerorun.runtime.sharded_state import ShardPlacement

__all__ = ["HostPlacement", "StepJob", "TileView", "pick_next", "warn_once"]

Event = Any  # torch.cuda.Event | None


@dataclass
class StepJob:
    """One optimizer step, prepared on the training thread (hyperparameters read before the
    scheduler moves them, step counters incremented) and run on the worker."""

    optimizer: Optimizer
    tiled: bool
    hypers: list[AdamHyper | None] = field(default_factory=list)
    states: list[dict[str, torch.Tensor] | None] = field(default_factory=list)


@dataclass
class TileView:
    """Where the tile loop reads and writes tile k of master i (views of the real storage, or
    I/O buffers that the iterator writes back after the update)."""

    i: int
    k: int
    a: int
    b: int
    param: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor | None


class HostPlacement(ShardPlacement):
    name = "cpu"
    # Where updated parameters are copied up from: a host staging buffer in the parameter dtype
    # (filled by the worker, converted on the CPU), or -- False -- the fp32 master itself, cast
    # on the GPU after the copy (saves the CPU a conversion pass, ~30% of the Adam time; PCIe
    # carries 4 bytes instead of 2, hidden behind the CPU step).
    stage_on_host = True
    # Twin-Flow: may some masters and states stay on the device (offload_optimizer.ratio < 1)?
    partial_ok = False
    # May the host take bf16 gradients when they are exact (options.narrow_grads)? Only where
    # the tile loop (adam_tile) is the only reader of the host gradients.
    narrow_ok = True

    def __init__(self, opts: OffloadOptions, device: torch.device) -> None:
        self.opts = opts
        self.device = device
        self.pin = opts.pin_memory and device.type == "cuda"
        if device.type == "cuda" and not opts.pin_memory:
            warn_once(
                "zero_optimization.offload_optimizer.pin_memory is false (DeepSpeed's default): host copies are "
                "synchronous and about half as fast, so they cannot overlap the CPU step; set pin_memory: true "
                "unless `ulimit -l` is small"
            )
        self.copier = Copier(device)
        self.runner = StepRunner(opts.step_threads(), device)
        self.delay = DelayPolicy(opts.delayed_update, opts.delayed_warmup)
        self.masters: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []  # fp32 gradient shards on the host (masters' .grad)
        # What the copies down fill and the tile loop reads: the fp32 shard, or -- narrow_grads,
        # the one-pass kernel available -- a bf16 view of its first half (2 bytes per element
        # down and read instead of 4; a non-Adam optimizer widens it into the shard first).
        self.wire: list[torch.Tensor] = []
        self.narrow = opts.narrow_grads and self.narrow_ok and self._kernel_ready()
        self.staging: list[torch.Tensor | None] = []  # updated shards, parameter dtype (H2D sources)
        self.tiles: list[list[tuple[int, int]]] = []
        self.on_device: list[bool] = []  # Twin-Flow: this master and its states on the device
        self._host: list[int] = []  # indices of the masters on the host
        self._plan: list[bool] | None = None  # from plan(): which masters stay on the device
        self._grad_ev: list[list[Event]] = []
        self._up_ev: list[list[Event]] = []  # last H2D copy out of each staging tile
        self._fresh: list[bool] = []  # staging holds an update its destination has not received
        self._host_dst = False  # this step copied into host destinations (stage 3 offload_param)
        self._targets: dict[int, torch.Tensor] = {}
        self._ready: Event = None  # event on the training stream at the start of this step
        self._last_down: Event = None  # most recent copy on each side stream: fencing on it
        self._last_up: Event = None  # orders every earlier copy of that stream too
        self._in_step = False
        self._launch: StepJob | None = None
        self._early: StepJob | None = None  # a step started during backward (grad_ready)
        self._early_work: list[tuple[int, Any]] = []  # (flat buffer, its worker future)
        # Early steps: the worker picks the next buffer with pick_next (_early_next) from
        # _queue, (priority, sequence, index) entries guarded by _sched; _stepped: buffer -> set
        # once its CPU update is done (also when it failed: _worker_error).
        self._sched = threading.Lock()
        self._queue: list[tuple[tuple[int, int], int, int]] = []
        self._seq = 0
        self._stepped: dict[int, threading.Event] = {}
        self._worker_error: BaseException | None = None
        # Stage 3 parameter offload, early step: host write-backs still in flight when step()
        # returns. _deferred: buffer -> set once its copy into the host shard is issued (by
        # _finish_early for buffers stepped during the backward, else by the worker right after
        # the update); settle() waits for it (the next forward's fetch, host readers, flush).
        # _unpushed: deferrable buffers stepped before _finish_early opened _deferred (both
        # under _sched, so each is copied exactly once); _deferred_after: the event the copies
        # are ordered after (the step's backward).
        self._deferred: dict[int, threading.Event] = {}
        self._unpushed: set[int] = set()
        # _failed: buffers whose early update raised (under _sched): no write-back ever comes for
        # them, so their _deferred event is set at once and settle() raises the worker's error
        # instead of waiting for good.
        self._failed: set[int] = set()
        self._deferred_after: Event = None
        self.steps = 0  # optimizer steps taken (delayed ones included)
        self.delayed_steps = 0
        self.early_steps = 0  # steps whose CPU work started during backward
        self.profile = StepProfile()
        # The delayed update's copies overlapping the next backward (dpu.CopyWindow): open from
        # the launch of a delayed update to the next step's grad_for_step; _copied: the buffers
        # whose copies (down: gradient, up: update) all went during that backward.
        self._window: CopyWindow | None = None
        self._copied: set[int] = set()
        self.overlapped_buffers = 0  # buffers copied during the backward (tests, docs)
        self._copy_thread: ThreadPoolExecutor | None = None  # queues the window's copies

    @staticmethod
    def _kernel_ready() -> bool:
        from zerorun.runtime.offload import cpu_kernel

        if cpu_kernel.load() is not None:
            return True
        warn_once(
            "the one-pass CPU Adam kernel (runtime/offload/cpu_kernel.py) could not be built here (no C compiler, "
            "or ZERORUN_CPU_KERNEL=0): the host takes fp32 gradients, 4 bytes per element instead of 2"
        )
        return False

    # -- storage (subclasses) -----------------------------------------------------------------
    def _new_master(self, index: int, numel: int, fp32_init: Callable[[], torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def _state_tensor(self, index: int, key: str) -> torch.Tensor:
        raise NotImplementedError

    def _tile_size(self) -> int:
        return self.opts.cpu_tile

    def _tile_views(self, job: StepJob, indices: list[int]) -> Iterator[TileView]:
        """Tiles of the masters ``indices``, in order."""
        raise NotImplementedError

    def _prepare_storage(self, job: StepJob) -> None:
        """Hook before the tile loop is launched (training thread)."""
        return None

    # -- ShardPlacement -------------------------------------------------------------------------
    def plan(self, numels: Sequence[int], layouts: Sequence[Any] | None = None, shard_index: int = 0) -> None:
        split = self.partial_ok and (self.opts.ratio is None or self.opts.ratio < 1.0)
        if split:
            order = ready_order(len(numels), self.opts.stage)
            self._plan = device_buffers(numels, self.opts.ratio, self.opts.device_budget_numel, order)
        else:
            self._plan = None

    def master_on_device(self, index: int) -> bool:
        """Does ``plan`` keep flat buffer ``index``'s master and states on the device (Twin-Flow)?
        Stage 3 then keeps that buffer's at-rest parameter as the fp32 master itself, as without
        offload (runtime/stage3/build.py), instead of a 16-bit shard beside an fp32 master."""
        return self._plan is not None and self._plan[index]

    @property
    def host_share(self) -> float:
        """The host's share of this rank's master elements (1.0 without Twin-Flow)."""
        total = sum(m.numel() for m in self.masters)
        host = sum(self.masters[i].numel() for i in self._host)
        return host / total if total else 1.0

    @property
    def optimizer_device(self) -> torch.device:
        return torch.device("cpu")

    def make_master(
        self, index: int, param_shard: torch.Tensor, fp32_init: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        n = param_shard.numel()
        if self._plan is not None and self._plan[index]:
            return self._device_master(param_shard, fp32_init)
        self._host.append(index)
        master = self._new_master(index, n, fp32_init)
        staging = None
        if self.stage_on_host:
            staging = host_empty(n, param_shard.dtype, pin=self.pin, lasting=True)
            with torch.no_grad():
                staging.copy_(master)
        parts = tiles(n, self._tile_size())
        self.masters.append(master)
        grads = host_empty(n, torch.float32, pin=self.pin, lasting=True)
        self.grads.append(grads)
        self.wire.append(grads.view(torch.bfloat16)[:n] if self.narrow else grads)
        self.staging.append(staging)
        self.tiles.append(parts)
        self._grad_ev.append([None] * len(parts))
        self._up_ev.append([None] * len(parts))
        self._fresh.append(False)
        self.on_device.append(False)
        return master

    def _device_master(self, param_shard: torch.Tensor, fp32_init: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A Twin-Flow master kept on the device: the parameter shard itself when it is fp32 on
        the device (fp32 training; stage 3's at-rest shard, master_on_device), else an fp32 device
        copy. No host buffers, no tiles."""
        if param_shard.dtype == torch.float32 and param_shard.device == self.device:
            master = param_shard
        else:
            master = fp32_init().to(self.device, torch.float32, copy=True)
        self.masters.append(master)
        self.grads.append(torch.empty(0))
        self.wire.append(self.grads[-1])
        self.staging.append(None)
        self.tiles.append([])
        self._grad_ev.append([])
        self._up_ev.append([])
        self._fresh.append(False)
        self.on_device.append(True)
        return master

    def _step_device(self, job: StepJob) -> None:
        """Twin-Flow: Adam(W) on the masters kept on the device (training thread; on CUDA the
        kernels queue on the training stream while the worker steps the host part)."""
        with torch.no_grad():
            for i, on_device in enumerate(self.on_device):
                master = self.masters[i]
                h, state = job.hypers[i], job.states[i]
                if not on_device or h is None or state is None or master.grad is None:
                    continue
                step = state["step"]
                if step.device != master.device:  # torch keeps Adam's counter on the CPU
                    step = torch.full((), float(step), dtype=torch.float32, device=master.device)
                adam_tile(
                    master,
                    master.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    state.get("max_exp_avg_sq"),
                    step,
                    h,
                )

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

    def _copy_down(self, index: int, grad_shard: torch.Tensor) -> None:
        host = self.wire[index]
        src = grad_shard.reshape(-1)
        self._grad_ev[index] = [self.copier.to_host(host[a:b], src[a:b], self._ready) for a, b in self.tiles[index]]
        self._last_down = self._grad_ev[index][-1]

    def grad_for_step(self, index: int, grad_shard: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        if self.on_device[index]:
            return grad_shard if grad_shard.dtype == master.dtype else grad_shard.to(master.dtype)
        if self._early is not None:
            if index not in self._stepped:
                self._copy_down(index, grad_shard)  # no reduction hook for this one
            return self.grads[index]
        if self.runner.busy:
            t0 = time.perf_counter()
            self.runner.join()  # a delayed step may still be reading self.grads
            self.profile.add("main_wait_s", time.perf_counter() - t0)
        self._flush_deferred()
        self._close_window()
        if not self._in_step:
            self._in_step = True
            self._ready = self.copier.ready()
        if index not in self._copied:  # (else its copies went during the backward)
            self._copy_down(index, grad_shard)
        return self.grads[index]

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

    def before_step(self) -> None:
        # Later work on the training stream (zeroing the gradient shards) must not overtake the
        # copies; one side stream, so the last event covers them all.
        self.copier.fence(self._last_down)

    def step(self, optimizer: Optimizer) -> None:
        t0 = time.perf_counter()
        try:
            self._step(optimizer)
        finally:
            self.profile.add("main_wait_s", time.perf_counter() - t0)

    @property
    def last_profile(self) -> dict[str, float]:
        """Where the last complete step's time went, seconds (`StepProfile`)."""
        return self.profile.last

    def _step(self, optimizer: Optimizer) -> None:
        if self._early is not None:
            self._finish_early()
            return
        self.runner.join()
        self._flush_deferred()
        tiled = supports_tiles(optimizer)
        delayed = self.delay.delayed(self.steps, tiled=tiled, optimizer_name=type(optimizer).__name__)
        job = self._prepare(optimizer, tiled)
        self.steps += 1
        if delayed:
            self._launch = job  # launched by after_write_back, once the previous update is copied
            self.delayed_steps += 1
        else:
            self.runner.submit(lambda: self._update(job, push=True))
            if tiled:
                self._step_device(job)  # concurrently with the host part on the worker
            self.runner.join()

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

    def _close_profile(self) -> None:
        self.profile.close(self.copier, self._param_copier())

    def _param_copier(self) -> Copier | None:
        """Stage 3 parameter offload's copier (its fetches), if any."""
        copier = getattr(self.param_store, "copier", None)
        return copier if isinstance(copier, Copier) else None

    def _flush_deferred(self) -> None:
        """Every deferred write-back done (before anything else touches masters or shards)."""
        for index in sorted(self._deferred, key=self._priority):
            self.settle(index)

    def settle_all(self) -> None:
        self._flush_deferred()

    def _source(self, index: int) -> torch.Tensor:
        staging = self.staging[index]
        return self.masters[index] if staging is None else staging

    def _push(self, index: int, dst: torch.Tensor, after: Event = None, *, deferred: bool = False) -> None:
        """Copy buffer ``index``'s update into ``dst`` (``deferred``: a write-back settle()
        completes -- not covered by this step's fences, any thread)."""
        flat, src = dst.reshape(-1), self._source(index)
        if not deferred:
            self._host_dst = self._host_dst or dst.device.type == "cpu"
        ready = self._ready if after is None else after
        for k, (a, b) in enumerate(self.tiles[index]):
            ev = self.copier.to_device(flat[a:b], src[a:b], ready)
            self._up_ev[index][k] = ev
            if not deferred:
                self._last_up = ev
        self._fresh[index] = False

    def write_back(self, index: int, master: torch.Tensor, dst: torch.Tensor) -> None:
        if self.on_device[index]:
            if master.data_ptr() != dst.data_ptr():
                dst.copy_(master)
            return
        if index in self._deferred:
            if self._targets.get(index) is dst:
                return  # its fetch (or the next step) copies it: settle()
            self.settle(index)
        if not self._in_step:
            # Outside a step (e.g. after a checkpoint load wrote the masters): the masters are
            # the truth; refresh the staging copy from them.
            self.runner.join()
            self._flush_deferred()
            self._ready = self.copier.ready()
            staging = self.staging[index]
            if staging is not None:
                with torch.no_grad():
                    staging.copy_(master)
            self._fresh[index] = True
        prev = self._targets.get(index)
        same = (
            prev is not None
            and prev.data_ptr() == dst.data_ptr()
            and prev.numel() == dst.numel()
            and prev.dtype == dst.dtype
        )
        self._targets[index] = dst
        if self._fresh[index] or not same:
            self._push(index, dst)

    def after_write_back(self) -> None:
        if self._host_dst:
            # Stage 3 parameter offload: the destinations are host shards, filled by copies
            # through the device (Copier._cast_through_device, one stream): complete when the
            # step returns, as the next forward's fetches and any host reader expect. In exact
            # mode only the last flat buffer's copies are still in flight here.
            t0 = time.perf_counter()
            Copier.wait(self._last_up)
            self.profile.add("main_wait_s", time.perf_counter() - t0)
            self._host_dst = False
        if self._deferred:
            self.profile.pending = True  # complete once the deferred write-backs are (settle)
        else:
            self._close_profile()
        self.copier.fence(self._last_up)
        job, self._launch = self._launch, None
        self._copied = set()
        if job is not None:
            # In the order the next backward makes the gradients final, so each buffer is free
            # for its copies as early as possible (dpu.CopyWindow); no clipping / fp16 check only.
            host = set(self._host)
            order = [i for i in ready_order(len(self.masters), self.opts.stage) if i in host]
            window = None
            if self.opts.early_start:
                if self._copy_thread is None:
                    self._copy_thread = ThreadPoolExecutor(1, thread_name_prefix="zerorun-copies")
                tiles_of = {i: len(self.tiles[i]) for i in order}
                window = self._window = CopyWindow(tiles_of, self._window_copy, self._copy_thread)
            self.runner.submit(lambda: self._update(job, push=False, indices=order, window=window))
        self._ready = None
        self._in_step = False

    # -- generic hooks (Contract 6) ------------------------------------------------------------
    def state_loaded(self, optimizer: Optimizer) -> None:
        """A resumed run continues the delayed update's warm-up where the saved run stopped: the
        step count is the optimizer's own (saved with its state), not zero."""
        counts = [int(st["step"]) for st in optimizer.state.values() if "step" in st]
        self.steps = max(counts, default=0)

    def phase_timer(self) -> PhaseSource:
        """wall_clock_breakdown (observe/timers.py OFFLOAD_PHASES): time the copies from now on
        and hand the step timers each step's sub-phases."""
        self.copier.timing = True
        param_copier = self._param_copier()
        if param_copier is not None:
            param_copier.timing = True
        return self.profile.take

    def synchronize(self) -> None:
        self.runner.join()  # (a step started during backward completes in step(); not here)
        self._flush_deferred()
        self._close_window()  # (a checkpoint: the next step copies at its end)
        self._copied = set()

    def close(self) -> None:
        try:
            self.runner.join()
            self._flush_deferred()  # the host shards hold the last update
        finally:
            self.runner.close()
            if self._copy_thread is not None:
                self._copy_thread.shutdown(wait=True)
                self._copy_thread = None
            if self.param_store is not None:
                self.param_store.close()

    def add_memory(self, ledger: Any) -> None:
        if self.param_store is not None:
            self.param_store.add_memory(ledger)
        ledger.add("grads", self.grads)
        ledger.add("buffers", [t for t in self.staging if t is not None])

    # -- the step ------------------------------------------------------------------------------
    def _prepare(self, optimizer: Optimizer, tiled: bool) -> StepJob:
        job = StepJob(optimizer, tiled)
        if not tiled:
            return job
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        for i, m in enumerate(self.masters):
            group = group_of.get(id(m))
            if group is None:  # not optimised (cannot happen with initialize's groups; be safe)
                job.hypers.append(None)
                job.states.append(None)
                continue
            h = hyper_of(optimizer, group)
            state = ensure_state(optimizer, m, h, make=lambda key, i=i: self._state_tensor(i, key))
            state["step"] += 1
            job.hypers.append(h)
            job.states.append(state)
        self._prepare_storage(job)
        return job

    def _update(
        self, job: StepJob, *, push: bool, indices: list[int] | None = None, window: CopyWindow | None = None
    ) -> None:
        """Worker thread: the optimizer step of the masters ``indices`` (all by default), then
        staging (+ H2D when ``push``; the delayed update: ``window`` is told each tile done)."""
        with torch.no_grad():
            if not job.tiled:
                for row in self._grad_ev + self._up_ev:
                    for ev in row:
                        Copier.wait(ev)
                for i in self._host:
                    if self.wire[i].dtype != self.grads[i].dtype:  # (a copy: the wire is in the shard)
                        self.grads[i].copy_(self.wire[i].clone())
                job.optimizer.step()  # masters' .grad are the host gradients (state.step set them)
                for i in self._host:  # (Twin-Flow masters on the device were stepped too)
                    m = self.masters[i]
                    for k, (a, b) in enumerate(self.tiles[i]):
                        self._stage_tile(i, k, a, b, m[a:b], push)
                return
            views = self._tile_views(job, list(self._host) if indices is None else indices)
            clock = time.perf_counter
            t0 = clock()
            for t in views:
                t1 = clock()
                Copier.wait(self._grad_ev[t.i][t.k])
                if not self.stage_on_host:  # the master tile is about to change: its last copy up is done
                    Copier.wait(self._up_ev[t.i][t.k])
                t2 = clock()
                h, state = job.hypers[t.i], job.states[t.i]
                if h is not None and state is not None:
                    adam_tile(
                        t.param,
                        self.wire[t.i][t.a : t.b],
                        t.exp_avg,
                        t.exp_avg_sq,
                        t.max_exp_avg_sq,
                        state["step"],
                        h,
                    )
                t3 = clock()
                self._stage_tile(t.i, t.k, t.a, t.b, t.param, push)
                if window is not None:
                    window.tile_done(t.i, t.k)
                t4 = clock()
                self.profile.add("io_wait_s", t1 - t0)  # NVMe: waiting for the tile read (in memory: ~0)
                self.profile.add("gradient_wait_s", t2 - t1)
                self.profile.add("adam_s", t3 - t2)
                self.profile.add("staging_s", t4 - t3)
                t0 = clock()

    def _stage_tile(self, i: int, k: int, a: int, b: int, updated: torch.Tensor, push: bool) -> None:
        staging = self.staging[i]
        if staging is not None:
            Copier.wait(self._up_ev[i][k])  # the previous copy out of this staging tile is done
            staging[a:b].copy_(updated)
        target = self._targets.get(i) if push else None
        if target is None:
            self._fresh[i] = True
            return
        self._host_dst = self._host_dst or target.device.type == "cpu"
        self._up_ev[i][k] = self._last_up = self.copier.to_device(
            target.reshape(-1)[a:b], self._source(i)[a:b], self._ready
        )
        if k == len(self.tiles[i]) - 1:
            self._fresh[i] = False


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


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A notice about this process's offload set-up, once per process (every placement of a run
    would repeat it)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)
