"""The one-step delayed parameter update (ZeRO-Offload's DPU), behind ``zerorun.delayed_param_update``.

Exact offload runs the CPU optimizer step between backward and the next forward, so the GPU
waits for it. With the delayed update the step of step t is *launched* at the end of step t and
runs on the CPU while the GPU computes step t+1's forward and backward; its result is copied to
the GPU at the end of step t+1. So step t+1's gradients are computed on parameters that lack the
update of step t:

    exact:    theta[t+1] = U(theta[t], grad L_t(theta[t]))
    delayed:  theta[t+1] = U(theta[t], grad L_t(theta[t-1]))        (theta[-1] = theta[0])

This changes the math (one-step-stale gradients, as in ZeRO-Offload, which found it harmless
after the first few steps -- hence ``delayed_param_update_warmup``: that many exact steps first).
Clipping and the fp16 overflow check still see the exact global norm of the gradients they
apply to. After ``engine.step()`` the module's parameters are one update behind the fp32 masters;
``ShardedOptimizerState.synchronize()`` (called by the engine before checkpoints) completes the
step in flight, so a checkpoint holds the newest masters and optimizer states.

Only optimizers the tile kernel supports (Adam, AdamW) are delayed: the step must read its
hyperparameters on the training thread before the scheduler changes them. Others run exactly,
with a warning.

The copies overlap the next backward (``CopyWindow``; no clipping, no fp16 check). Of one flat
buffer, tile by tile, while the update of step t runs on the worker during step t+1's
forward/backward:

* the gradient of step t+1 goes down into the host gradient buffer once its reduction is final
  (the stage's ``grad_ready`` hook, at the accumulation boundary's backward) AND the worker has
  read that tile's gradient of step t (it stepped the tile);
* the update of step t goes up into the device parameter shard at the same moment: the worker
  has written the tile, and the backward no longer reads the buffer's parameters (its gradients
  are final). The next forward sees it, as before; the backward of t+1 saw the old values.

Whichever thread sees the second condition hands the tile's two copies to the placement's copy
thread (the worker after a tile, the training thread in ``grad_ready``), which queues them on the
copy streams: queuing a copy costs the calling thread ~0.5 ms per tile on the H200 host with the
training loop beside it (the GIL, the CUDA calls), 42 ms per step of the worker's time when the
worker queued them itself (``offload_profile.staging_s`` in
``benchmarks/results/20261201T202221Z-1.3B-w1-thr__zero2_offload_dpu.json``). At the end of step
t+1 only the copies of the tiles the worker finished after the backward remain; the worker steps the buffers in the order their
gradients become final (``twinflow.ready_order``), so those are few. Buffers with no
``grad_ready`` (a parameter without a gradient, a stage that does not call it) are copied at the
step as before. No extra host memory: the host gradient buffer of a tile is reused only once the
worker is done with it. With clipping or the fp16 overflow check the gradients the CPU steps are
known only after the whole backward (the norm), so those steps copy at the end of the step, as
before; so do stage 3's parameter-offload write-backs into host shards (the next forward fetches
them). A checkpoint (``synchronize``) closes the window: the next step copies at its end.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from typing import Any

__all__ = ["CopyWindow", "DelayPolicy"]


class DelayPolicy:
    def __init__(self, enabled: bool, warmup: int) -> None:
        self.enabled = enabled
        self.warmup = max(0, warmup)
        self._warned = False

    def delayed(self, step_index: int, *, tiled: bool, optimizer_name: str) -> bool:
        """Is the optimizer step with this 0-based index delayed?"""
        if not self.enabled or step_index < self.warmup:
            return False
        if not tiled:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"zerorun.delayed_param_update: {optimizer_name} is not supported by the delayed CPU step "
                    "(Adam and AdamW are); the optimizer steps without the delay",
                    stacklevel=3,
                )
            return False
        return True


class CopyWindow:
    """The per-tile bookkeeping of the copies that overlap the next backward (module docstring):
    a tile's copies are queued (``issue(buffer, tile, ready)``) once the worker finished it
    (``tile_done``) and its buffer's gradient is final (``grad_ready`` with ``ready``: what the
    copies are ordered after). With an ``executor`` (one thread) ``issue`` runs there, in the
    order the tiles became due (submitted under this window's lock); without one, at once in
    the calling thread. ``close`` (after the worker was joined) ends it, waits until every
    ``issue`` ran (raising its error, if any) and names the buffers whose copies all went."""

    def __init__(
        self, tiles: Mapping[int, int], issue: Callable[[int, int, Any], None], executor: Executor | None = None
    ) -> None:
        self._lock = threading.Lock()
        self._count = dict(tiles)  # buffer -> its tiles
        self._done = dict.fromkeys(self._count, 0)  # tiles the worker finished, in order
        self._issued = dict.fromkeys(self._count, 0)  # tiles whose copies are queued, in order
        self._ready: dict[int, Any] = {}
        self._issue = issue
        self._executor = executor
        self._submitted: list[Future[None]] = []
        self._open = True
        self.by_worker = 0  # tiles whose copies the worker queued (the rest: the training thread)
        self.by_trainer = 0

    def tile_done(self, index: int, tile: int) -> None:
        """Worker: tile ``tile`` of buffer ``index`` is updated (its gradient read, its result
        written)."""
        with self._lock:
            if index in self._done:
                self._done[index] = tile + 1
                self.by_worker += self._flush(index)

    def grad_ready(self, index: int, ready: Any) -> bool:
        """Training thread: buffer ``index``'s gradient is final; False when this window does
        not take it (closed, not a host buffer, already taken)."""
        with self._lock:
            if not self._open or index not in self._count or index in self._ready:
                return False
            self._ready[index] = ready
            self.by_trainer += self._flush(index)
            return True

    def _flush(self, index: int) -> int:
        ready = self._ready.get(index)
        if ready is None or not self._open:
            return 0
        start = self._issued[index]
        while self._issued[index] < self._done[index]:
            if self._executor is None:
                self._issue(index, self._issued[index], ready)
            else:
                self._submitted.append(self._executor.submit(self._issue, index, self._issued[index], ready))
            self._issued[index] += 1
        return self._issued[index] - start

    def close(self) -> set[int]:
        """No more copies from this window; once every one handed over is queued, the buffers
        whose every tile's copies are."""
        with self._lock:
            self._open = False
            whole = {i for i in self._ready if self._issued[i] == self._count[i]}
            submitted, self._submitted = self._submitted, []
        for future in submitted:
            future.result()
        return whole
