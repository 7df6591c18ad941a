"""Gradient reduction for stages 0, 1 and 2, overlapping the backward pass.

A post-accumulate-grad hook on every trainable parameter moves its fresh gradient (compute
dtype) into reduce-dtype memory of its flat buffer and frees ``p.grad`` at once. When every
parameter of a flat buffer has reported, that buffer's collective is issued -- strictly in
launch order, the same on every rank (index order in the first backward, then the order in
which rank 0 saw buffers complete), so all ranks issue the same collectives in the same order
even when a parameter is unused on some rank (its slot is zero-filled when the backward ends). At most
``max_inflight`` collectives are outstanding; older ones are retired first, which bounds the
memory of stage 2's staging buffers.

* ``AllReduceGrads`` (stage 0): full reduce-dtype gradients accumulate across micro-steps; at
  the boundary each buffer is all-reduced.
* ``BoundaryReduceScatter`` (stage 1): same full accumulation; at the boundary each buffer is
  reduce-scattered in place, so this rank's shard of it holds the reduced gradient.
* ``PartitionedGrads`` (stage 2): each micro-step a buffer's gradients go into a staging
  buffer that is reduce-scattered and freed; only this rank's shard is kept and accumulates.

Gradient memory (the accumulation buffers of stages 0/1, the shards of stage 2) is allocated per
flat buffer when its first gradient of the step arrives and dropped by ``zero_grad`` after the
optimizer step, as stage 3 does: between steps it is free (the next forward's activations reuse
the blocks), and during backward buffers appear as the activations they replace are freed.

Averaging divides by the world size before the sum (gloo has no PREMUL_SUM). For a power-of-two
world the division is folded into the hook's copy/add (``x * 2**-k`` is exact, so the result is
bitwise the same and one pass over the buffer is saved); otherwise the buffer is divided before
its collective.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerorun.errors import RuntimeConfigError
from zerorun.runtime.collectives import Communicator, Pending
from zerorun.runtime.flat_params import FlatParamBuffers

__all__ = ["GradReducer", "AllReduceGrads", "BoundaryReduceScatter", "PartitionedGrads"]


class GradReducer:
    """Hooks + ordered launching; subclasses say where gradients go and what is issued."""

    max_inflight = 2

    def __init__(self, flat: FlatParamBuffers, comm: Communicator, reduce_dtype: torch.dtype) -> None:
        self.flat = flat
        self.comm = comm
        self.reduce_dtype = reduce_dtype
        self.world = comm.world_size
        self.shard = comm.rank if flat.layouts and flat.layouts[0].num_shards > 1 else 0
        n = len(flat.layouts)
        averaging = not comm.trivial and self.world > 1
        pow2 = self.world & (self.world - 1) == 0
        # 1/world applied as gradients arrive (exact for powers of two), else before issuing.
        self._prescale: float | None = 1.0 / self.world if averaging and pow2 else None
        self._postdivide = averaging and not pow2
        self._reported = [0] * n
        self._written: list[list[bool]] = [[False] * len(layout.slots) for layout in flat.layouts]
        self._next = 0  # position in self._order of the next buffer to issue
        # Launch order, identical on every rank. The first backward uses index order and records
        # the order in which buffers actually completed; rank 0's record is then adopted by all
        # (one small broadcast, once). So a parameter that is never used (an unused head or
        # pooler) no longer holds back every bucket after it, only its own -- as DDP rebuilds
        # its buckets after the first iteration. An order that later changes stays correct.
        self._order: list[int] = list(range(n))
        self._learn_order = n > 1 and not comm.trivial
        self._ready_seq: list[int] = []
        self._pending: deque[tuple[int, Pending]] = deque()  # (flat buffer index, its collective)
        self._launching = 0
        self._tracked = False
        # Called with a flat buffer's index once this rank's reduced gradient of it is final for
        # the step: at the accumulation boundary, after its collective completed (the Pending
        # waited: ordered into the caller's stream on CUDA), or right away when nothing is
        # issued (one rank). An offload placement starts the CPU step there (Contract 6).
        self.on_grad_ready: Callable[[int], None] | None = None
        self._open = False
        self.boundary = True
        self.first_micro = True
        self.launches = 0  # collectives issued (tests assert overlap really happened)
        self.launched_during_backward = 0
        self._in_backward = False
        self.peak_buffer_bytes = 0
        self._handles = []
        for i, params in enumerate(flat.params):
            for k, p in enumerate(params):
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(i, k)))

    # -- lifecycle driven by the engine -------------------------------------------------------
    def begin(self, *, boundary: bool, first_micro: bool) -> None:
        self.boundary = boundary
        self.first_micro = first_micro
        self._reported = [0] * len(self.flat.layouts)
        self._written = [[False] * len(layout.slots) for layout in self.flat.layouts]
        self._next = 0
        self._open = True
        self._in_backward = True

    def end_backward(self) -> None:
        """Zero-fill slots of unused parameters, issue what is left (in order), wait for all."""
        if not self._open:
            return
        self._in_backward = False
        for pos in range(self._next, len(self._order)):
            i = self._order[pos]
            self._fill_unwritten(i)
            self._issue(i)
        self._next = len(self._order)
        while self._pending:
            self._retire()
        self._open = False
        if self._learn_order:
            self._adopt_order()

    def _adopt_order(self) -> None:
        seen = set(self._ready_seq)
        record = self._ready_seq + [i for i in range(len(self._order)) if i not in seen]
        self._order = self.comm.broadcast_ints(record)
        self._learn_order = False

    def grad_shards(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def grad_shard(self, i: int) -> torch.Tensor:
        """Flat buffer ``i``'s entry of ``grad_shards()`` alone (allocates no other buffer)."""
        return self.grad_shards()[i]

    def zero_grad(self) -> None:
        raise NotImplementedError

    def buffers(self) -> list[torch.Tensor]:
        """Persistent gradient memory (for the memory summary)."""
        raise NotImplementedError

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- internals ----------------------------------------------------------------------------
    def _hook(self, i: int, k: int) -> Any:
        def hook(p: nn.Parameter) -> None:
            if not self._open:  # backward not started through the engine: treat as a micro-step
                self.begin(boundary=self.boundary, first_micro=self.first_micro)
            grad = p.grad
            p.grad = None  # the 16-bit full gradient is not kept: that is the point of the stage
            if grad is None:
                return
            slot = self.flat.layouts[i].slots[k]
            if self._written[i][k]:
                # Reentrant activation checkpointing runs one backward per segment: a parameter
                # used in two segments reports twice, after its bucket may already be on the wire.
                raise RuntimeConfigError(
                    f"parameter {slot.name!r} received its gradient twice in one backward pass "
                    "(a module shared between reentrant activation-checkpoint segments?). Use "
                    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False), or ZeRO stage 3."
                )
            self._accept(i, k, slot.offset, slot.numel, grad.reshape(-1))
            self._written[i][k] = True
            self._reported[i] += 1
            if self._reported[i] == len(self.flat.layouts[i].slots):
                if self._learn_order:
                    self._ready_seq.append(i)
                self._launch_ready()

        return hook

    def _launch_ready(self) -> None:
        layouts, order = self.flat.layouts, self._order
        while self._next < len(order) and self._reported[order[self._next]] == len(
            layouts[order[self._next]].slots
        ):
            self._issue(order[self._next])
            self._next += 1

    def _issue(self, i: int) -> None:
        self._launching, self._tracked = i, False
        self._launch(i)
        if not self._tracked and self.boundary and self.on_grad_ready is not None:
            self.on_grad_ready(i)  # nothing in flight for it: final already

    def _retire(self) -> None:
        i, pending = self._pending.popleft()
        pending.wait()
        if self.boundary and self.on_grad_ready is not None:
            self.on_grad_ready(i)

    def _track(self, pending: Pending) -> None:
        self.launches += 1
        if self._in_backward:
            self.launched_during_backward += 1
        self._tracked = True
        self._pending.append((self._launching, pending))
        while len(self._pending) > self.max_inflight:
            self._retire()

    def _accept(self, i: int, k: int, offset: int, numel: int, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def _fill_unwritten(self, i: int) -> None:
        return None

    def _launch(self, i: int) -> None:
        raise NotImplementedError


class _FullAccumulation(GradReducer):
    """Full reduce-dtype gradient buffers that accumulate across micro-steps (stages 0 and 1)."""

    # Buffers that nothing else touches until end_backward: no memory to bound, and retiring
    # early would only make the compute stream wait for the network.
    max_inflight = 1 << 30

    def __init__(self, flat: FlatParamBuffers, comm: Communicator, reduce_dtype: torch.dtype) -> None:
        super().__init__(flat, comm, reduce_dtype)
        n = len(flat.layouts)
        self.acc: list[torch.Tensor | None] = [None] * n  # allocated lazily: _acc(i)
        self._views: list[list[torch.Tensor]] = [[] for _ in range(n)]  # each parameter's slice

    def _acc(self, i: int) -> torch.Tensor:
        a = self.acc[i]
        if a is None:
            layout = self.flat.layouts[i]
            a = torch.zeros(layout.padded_numel, dtype=self.reduce_dtype, device=self.flat.device)
            self.acc[i] = a
            self._views[i] = [a[slot.offset : slot.offset + slot.numel] for slot in layout.slots]
        return a

    def _accept(self, i: int, k: int, offset: int, numel: int, grad: torch.Tensor) -> None:
        self._acc(i)
        if self._prescale is None:
            self._views[i][k].add_(grad)
        else:
            self._views[i][k].add_(grad, alpha=self._prescale)

    def _average(self, i: int) -> torch.Tensor:
        a = self._acc(i)
        if self._postdivide:
            a.div_(self.world)
        return a

    def zero_grad(self) -> None:
        self.acc = [None] * len(self.flat.layouts)
        self._views = [[] for _ in self.flat.layouts]

    def buffers(self) -> list[torch.Tensor]:
        return [a for a in self.acc if a is not None]


class AllReduceGrads(_FullAccumulation):
    def _launch(self, i: int) -> None:
        if not self.boundary or self.comm.trivial:
            return
        self._track(self.comm.all_reduce(self._average(i)))

    def grad_shards(self) -> list[torch.Tensor]:
        return [self._acc(i) for i in range(len(self.flat.layouts))]

    def grad_shard(self, i: int) -> torch.Tensor:
        return self._acc(i)


class BoundaryReduceScatter(_FullAccumulation):
    def _launch(self, i: int) -> None:
        if not self.boundary or self.comm.trivial:
            return
        start, end = self.flat.layouts[i].shard_range(self.shard)
        a = self._average(i)
        self._track(self.comm.reduce_scatter(a[start:end], a))

    def grad_shards(self) -> list[torch.Tensor]:
        return [self.grad_shard(i) for i in range(len(self.flat.layouts))]

    def grad_shard(self, i: int) -> torch.Tensor:
        start, end = self.flat.layouts[i].shard_range(self.shard)
        return self._acc(i)[start:end]


class PartitionedGrads(GradReducer):
    def __init__(self, flat: FlatParamBuffers, comm: Communicator, reduce_dtype: torch.dtype) -> None:
        super().__init__(flat, comm, reduce_dtype)
        n = len(flat.layouts)
        # None until the step's first gradient for the buffer: a shard not yet written since
        # zero_grad takes the reduce-scatter output directly (no zeros, no add). Tracked per
        # buffer rather than from the micro-step counter, so several backward passes before one
        # step still accumulate.
        self.shards: list[torch.Tensor | None] = [None] * n
        self._staging: dict[int, torch.Tensor] = {}
        # Each parameter's slice of its shard; used on one rank only, where the shard is the
        # whole buffer.
        self._views: list[list[torch.Tensor]] = [[] for _ in range(n)]

    def _zeros_shard(self, i: int) -> torch.Tensor:
        shard = self.shards[i]
        if shard is None:
            layout = self.flat.layouts[i]
            shard = torch.zeros(layout.shard_numel, dtype=self.reduce_dtype, device=self.flat.device)
            self.shards[i] = shard
            if self.comm.trivial:
                self._views[i] = [shard[slot.offset : slot.offset + slot.numel] for slot in layout.slots]
        return shard

    def _staging_for(self, i: int) -> torch.Tensor:
        buf = self._staging.get(i)
        if buf is None:
            layout = self.flat.layouts[i]
            buf = torch.empty(layout.padded_numel, dtype=self.reduce_dtype, device=self.flat.device)
            buf[layout.numel :].zero_()
            for a, b in layout.gaps():  # between slot-aligned parameters
                buf[a:b].zero_()
            self._staging[i] = buf
            live = sum(b.numel() * b.element_size() for b in self._staging.values())
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, live + self._inflight_bytes())
        return buf

    def _inflight_bytes(self) -> int:
        return len(self._pending) * max(
            (b.numel() * b.element_size() for b in self._staging.values()), default=0
        )

    def _accept(self, i: int, k: int, offset: int, numel: int, grad: torch.Tensor) -> None:
        if self.comm.trivial:
            # One rank: the shard is the whole buffer; accumulate into it, no staging, no copy.
            self._zeros_shard(i)
            self._views[i][k].add_(grad)
            return
        dst = self._staging_for(i)[offset : offset + numel]
        if self._prescale is None:
            dst.copy_(grad)
        elif grad.dtype == torch.float16 and dst.dtype != torch.float16:
            # torch.mul computes in the input's dtype, and fp16 (unlike bf16) has subnormals in
            # the range gradients reach, where halving rounds: scale in the wider dtype instead.
            dst.copy_(grad).mul_(self._prescale)
        else:
            torch.mul(grad, self._prescale, out=dst)  # cast + average in one pass (exact)

    def _fill_unwritten(self, i: int) -> None:
        if self.comm.trivial:
            return
        buf = self._staging_for(i)
        for slot, written in zip(self.flat.layouts[i].slots, self._written[i], strict=True):
            if not written:
                buf[slot.offset : slot.offset + slot.numel].zero_()

    def _launch(self, i: int) -> None:
        if self.comm.trivial:
            return
        staging = self._staging.pop(i)
        if self._postdivide:
            staging.div_(self.world)
        shard = self.shards[i]
        if shard is None:
            # First gradient since zero_grad: reduce straight into a new kept shard.
            layout = self.flat.layouts[i]
            shard = torch.empty(layout.shard_numel, dtype=self.reduce_dtype, device=self.flat.device)
            self.shards[i] = shard
            self._track(self.comm.reduce_scatter(shard, staging))
        else:
            out = torch.empty_like(shard)
            self._track(self.comm.reduce_scatter(out, staging, then=lambda: shard.add_(out)))

    def grad_shards(self) -> list[torch.Tensor]:
        # Zeros for a buffer nothing was reduced into (a step without backward).
        return [self._zeros_shard(i) for i in range(len(self.flat.layouts))]

    def grad_shard(self, i: int) -> torch.Tensor:
        return self._zeros_shard(i)

    def zero_grad(self) -> None:
        self.shards = [None] * len(self.flat.layouts)
        self._views = [[] for _ in self.flat.layouts]

    def buffers(self) -> list[torch.Tensor]:
        return [s for s in self.shards if s is not None]
