"""One stage-3 parameter group's life: shard at rest, gather, release, reduce-scatter gradients.

Tensors of a group (words of partition.py: flat buffer, shard):

* **at-rest shard** -- this rank's shard of each flat buffer, held by the ``ParamShardStore``
  (param_store.py). The optimizer write-back lands here. Its dtype is ``rest_dtype``: the compute
  dtype, or fp32 when the fp32 master shard itself can be the at-rest parameter (masters and
  shards both on the device): then no separate 16-bit shard is kept (ZeRO's 16 bytes per
  parameter / N instead of 18) and the gather casts the shard to the compute dtype on the way
  (FSDP2's mixed-precision gather).
* **gather buffer** -- the whole flat buffer, compute dtype, the all-gather's output. Its
  *storage* is allocated when the group is gathered and resized to 0 bytes when it is released;
  the tensor object and the per-parameter views into it live as long as the group, so views the
  autograd graph saved in forward see the re-gathered values in backward and keep no memory
  alive in between (FSDP2's trick).
* **parameters** -- the user's ``nn.Parameter`` objects. Gathered: ``p.data`` is its view of
  the gather buffer (right shape, no copy). Released: ``p.data`` is an empty placeholder of
  shape ``[0]`` (DeepSpeed's convention), so code touching a released parameter gets a shape
  error instead of reading freed memory; ``p.ds_shape`` / ``p.ds_numel`` keep the real shape.
* **gradient shard** -- this rank's reduced gradients, reduce dtype, accumulated across
  micro-steps. Allocated by the step's first reduction and dropped by ``zero_grad`` after the
  optimizer step (``set_to_none``), so no gradient memory exists during the forward, where
  activations peak. A group's full gradients exist only between its backward and its
  reduce-scatter.

Two kinds of groups never gather or release (``resident``): the persistent group (small
parameters, replicated) and, with one rank and shards on the device, every group (the shard is
the whole buffer: nothing to gather).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from zerorun.runtime.collectives import Communicator, Pending
from zerorun.runtime.partition import FlatLayout
from zerorun.runtime.stage3.param_store import ParamShardStore

if TYPE_CHECKING:
    from zerorun.runtime.stage3.stage import Stage3

__all__ = ["ParamGroup", "RELEASED", "GATHERING", "GATHERED"]

RELEASED, GATHERING, GATHERED = 0, 1, 2


class ParamGroup:
    def __init__(
        self,
        index: int,
        name: str,
        module: nn.Module | None,
        layouts: Sequence[FlatLayout],
        params: Sequence[Sequence[nn.Parameter]],
        *,
        comm: Communicator,
        device: torch.device,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        store: ParamShardStore,
        persistent: bool,
        fp32_shards: Sequence[torch.Tensor],
        rest_dtype: torch.dtype | None = None,
    ) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.layouts = list(layouts)
        self.params = [list(ps) for ps in params]
        self.comm = comm
        self.device = device
        self.dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.store = store
        self.persistent = persistent
        self.world = comm.world_size
        self.rank = comm.rank
        # One rank and no forced collectives (ZERORUN_DEBUG_COLLECTIVES): gathers and reductions
        # are plain copies.
        self.trivial = bool(getattr(comm, "trivial", self.world == 1))
        self.rest_dtype = param_dtype if (persistent or rest_dtype is None) else rest_dtype
        # Prefetching overlaps a collective or a host->device copy with compute. With one rank
        # and the shard on the device, "gathering" is a cast-copy on the compute stream (the
        # all-gather is in place, gather_async: with real collectives too, it moves nothing):
        # nothing to overlap, so a prefetched group would only hold memory earlier (a whole
        # block at the activation peak). FSDP2 skips both its all-gather and its prefetch there.
        self.prefetch_pays = not (self.world == 1 and store.resident)
        self.resident = persistent or (self.world == 1 and store.resident and self.rest_dtype == param_dtype)
        self.numel = sum(layout.padded_numel for layout in self.layouts)
        self.state = RELEASED
        self.holds = 0  # GatheredParameters contexts holding the group gathered
        self.stage: Stage3 | None = None  # the Stage3 owning the group (model_io reaches the masters through it)
        # Completes flat buffer i's write-back that the optimizer placement left in flight after
        # the step (ShardPlacement.settle; Stage3 sets it when the placement may defer): called
        # before the at-rest shard is read -- the gather, a resident group's forward, model_io.
        self.before_read: Callable[[int], None] | None = None
        self._pending: list[Pending] = []
        self._fetched: list[torch.Tensor] = []
        self._placeholder = torch.empty(0, dtype=param_dtype, device=device)
        self.full: list[torch.Tensor] = []
        self.at_rest: list[torch.Tensor] = []
        self._flat_params: list[nn.Parameter] = []
        self._flat_views: list[torch.Tensor] = []
        self._pads: list[torch.Tensor] = []
        esize = torch.empty((), dtype=param_dtype).element_size()
        self.nbytes = self.numel * esize
        for layout, ps, fp32 in zip(self.layouts, self.params, fp32_shards, strict=True):
            full = torch.zeros(layout.padded_numel, dtype=param_dtype, device=device)
            start, end = layout.shard_range(self.rank)
            if self.resident:
                full[start:end].copy_(fp32)
                rest = full[start:end]
            else:
                rest = store.allocate(layout.index, layout.shard_numel, self.rest_dtype)
                rest.copy_(fp32)
            self.full.append(full)
            self.at_rest.append(rest)
            for slot, p in zip(layout.slots, ps, strict=True):
                self._flat_params.append(p)
                self._flat_views.append(full[slot.offset : slot.offset + slot.numel].view(slot.shape))
                p.ds_shape = torch.Size(slot.shape)  # type: ignore[attr-defined]
                p.ds_numel = slot.numel  # type: ignore[attr-defined]
                p._zerorun_group = self  # type: ignore[attr-defined]
            self._pads.append(
                torch.zeros(layout.padded_numel - layout.numel, device=device, dtype=param_dtype)
            )
        self.grad_shards: list[torch.Tensor | None] = [None] * len(self.layouts)
        if self.resident:
            if self.world > 1:
                for pending in [self.comm.all_gather(f, r) for f, r in zip(self.full, self.at_rest, strict=True)]:
                    pending.wait()
            self._bind()
            self.state = GATHERED
        else:
            for f in self.full:
                f.untyped_storage().resize_(0)
            self._unbind()

    # -- gather / release -----------------------------------------------------------------------
    def gather_async(self) -> bool:
        """Issue the all-gather (storage allocated on the caller's stream, collective on the
        communication stream). Returns False if the group was not released."""
        if self.state != RELEASED:
            return False
        self.settle()
        self._fetched = []
        for layout, full, rest in zip(self.layouts, self.full, self.at_rest, strict=True):
            full.untyped_storage().resize_(full.numel() * full.element_size())
            fetched = self.store.fetch(layout.index, rest)
            self._fetched.append(fetched)
            shard = fetched
            if fetched.dtype != self.dtype:
                # fp32 at rest: cast this rank's shard straight into its own slot of the gather
                # buffer and gather in place (FSDP2's copy-in): no shard-sized 16-bit temporary
                # alive until the wait, and the collective moves 16-bit data. With one rank the
                # slot is the whole buffer and the all-gather has nothing left to move.
                start, end = layout.shard_range(self.rank)
                shard = full[start:end]
                shard.copy_(fetched)
            self._pending.append(self.comm.all_gather(full, shard))
        self.state = GATHERING
        return True

    def wait(self) -> None:
        """Make the gathered values usable on the caller's stream and expose the parameters."""
        if self.state == RELEASED:
            self.gather_async()
        elif self.resident:
            self.settle()  # the parameters are the at-rest shards (one rank) or their replicas
        if self.state == GATHERING:
            for p in self._pending:
                p.wait()
            self._pending = []
            for layout, fetched in zip(self.layouts, self._fetched, strict=True):
                self.store.release(layout.index, fetched)
            self._fetched = []
            self._bind()
            self.state = GATHERED

    def settle(self, li: int | None = None) -> None:
        """The at-rest shard of flat buffer ``li`` (all: None) holds the last step's update."""
        if self.before_read is None:
            return
        for layout in self.layouts if li is None else [self.layouts[li]]:
            self.before_read(layout.index)

    def release(self, *, force: bool = False) -> bool:
        if self.resident or self.state == RELEASED or (self.holds and not force):
            return False
        if self.state == GATHERING:
            self.wait()
        self._unbind()
        for f in self.full:
            f.untyped_storage().resize_(0)
        self.state = RELEASED
        return True

    def _bind(self) -> None:
        for p, v in zip(self._flat_params, self._flat_views, strict=True):
            p.data = v

    def _unbind(self) -> None:
        for p in self._flat_params:
            p.data = self._placeholder

    @property
    def live(self) -> bool:
        """Counts against stage3_max_live_parameters (gathered or being gathered)."""
        return not self.resident and self.state != RELEASED

    # -- gradients ------------------------------------------------------------------------------
    def reduce_grads(self) -> list[Pending]:
        """Copy the group's full gradients into one reduce-dtype buffer per flat buffer (one
        kernel each), free them, and reduce-scatter into the gradient shard (averaged)."""
        out: list[Pending] = []
        k = 0
        # One rank with real collectives (ZERORUN_DEBUG_COLLECTIVES): the shard is the whole
        # buffer, so the reduction runs in place and the staging buffer becomes the shard.
        in_place = self.world == 1 and not self.trivial
        for li, (layout, pad) in enumerate(zip(self.layouts, self._pads, strict=True)):
            shard = self.grad_shards[li]
            fresh = shard is None  # first reduction since zero_grad: write instead of add
            if shard is None and not in_place:
                shard = torch.empty(layout.shard_numel, dtype=self.reduce_dtype, device=self.device)
                self.grad_shards[li] = shard
            parts = []
            pos = 0
            for slot in layout.slots:
                if slot.offset > pos:  # the gap before a slot-aligned parameter
                    parts.append(torch.zeros(slot.offset - pos, dtype=self.dtype, device=self.device))
                pos = slot.offset + slot.numel
                p = self._flat_params[k]
                k += 1
                g = p.grad
                p.grad = None
                parts.append(
                    g.reshape(-1)
                    if g is not None
                    else torch.zeros(slot.numel, dtype=self.dtype, device=self.device)
                )
            if pad.numel():
                parts.append(pad)
            if self.trivial:
                assert shard is not None
                if fresh:
                    torch.cat(parts, out=shard)
                else:
                    shard.add_(torch.cat(parts))
                continue
            staging = torch.empty(layout.padded_numel, dtype=self.reduce_dtype, device=self.device)
            torch.cat(parts, out=staging)
            del parts
            if in_place:  # (nothing to divide by)
                if shard is None:
                    self.grad_shards[li] = staging
                    out.append(self.comm.reduce_scatter(staging, staging))
                else:
                    out.append(self.comm.reduce_scatter(staging, staging, then=functools.partial(shard.add_, staging)))
                continue
            assert shard is not None
            # Pre-divide: gloo has no PREMUL_SUM (exact for powers of two, as in grad_reduce.py).
            staging.div_(self.world)
            if fresh:
                out.append(self.comm.reduce_scatter(shard, staging))
            else:
                tmp = torch.empty_like(shard)
                out.append(self.comm.reduce_scatter(tmp, staging, then=functools.partial(shard.add_, tmp)))
        return out

    def staging_bytes(self) -> int:
        esize = torch.empty((), dtype=self.reduce_dtype).element_size()
        return 0 if self.trivial else max(layout.padded_numel for layout in self.layouts) * esize

    def grad_shard(self, li: int) -> torch.Tensor:
        """The reduced gradient shard (zeros if nothing was reduced since zero_grad)."""
        shard = self.grad_shards[li]
        if shard is None:
            shard = torch.zeros(self.layouts[li].shard_numel, dtype=self.reduce_dtype, device=self.device)
            self.grad_shards[li] = shard
        return shard

    def zero_grad(self) -> None:
        self.grad_shards = [None] * len(self.layouts)

    # -- after the optimizer step ---------------------------------------------------------------
    def refresh_replicas(self) -> list[Pending]:
        """Persistent group: all-gather the updated shards into the replicated buffer."""
        if not self.persistent or self.world == 1:
            return []
        return [self.comm.all_gather(f, r) for f, r in zip(self.full, self.at_rest, strict=True)]

    def param_names(self) -> list[str]:
        return [slot.name for layout in self.layouts for slot in layout.slots]

    def find(self, p: nn.Parameter) -> tuple[int, int]:
        """(layout position, slot position) of a parameter of this group."""
        k = 0
        for li, layout in enumerate(self.layouts):
            for si in range(len(layout.slots)):
                if self._flat_params[k] is p:
                    return li, si
                k += 1
        raise KeyError("parameter not in this group")
