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

What starts during the backward -- the exact step started early (``grad_ready``), the
write-backs it leaves in flight (``settle``), the delayed update's copy window -- is in
early_step.py (``EarlyStep``, this class's base); this module keeps the storage, the copies and
the tile loop.
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
from zerorun.runtime.offload import cpu_kernel
from zerorun.runtime.offload.adam import AdamHyper, adam_tile, ensure_state, hyper_of, supports_tiles
from zerorun.runtime.offload.dpu import CopyWindow, DelayPolicy
from zerorun.runtime.offload.early_step import EarlyStep, pick_next
from zerorun.runtime.offload.host import Copier, host_empty, tiles
from zerorun.runtime.offload.options import OffloadOptions
from zerorun.runtime.offload.runner import StepRunner
from zerorun.runtime.offload.step_profile import StepProfile
from zerorun.runtime.offload.twinflow import device_buffers, ready_order

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


class HostPlacement(EarlyStep):
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

    def _close_profile(self) -> None:
        self.profile.close(self.copier, self._param_copier())

    def _param_copier(self) -> Copier | None:
        """Stage 3 parameter offload's copier (its fetches), if any."""
        copier = getattr(self.param_store, "copier", None)
        return copier if isinstance(copier, Copier) else None

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
            # A Twin-Flow master on the device keeps torch's own states beside it (zeros_like);
            # the host ones are the subclass's storage.
            make = None if self.on_device[i] else (lambda key, i=i: self._state_tensor(i, key))
            state = ensure_state(optimizer, m, h, make=make)
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


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A notice about this process's offload set-up, once per process (every placement of a run
    would repeat it)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)
