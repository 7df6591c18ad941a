"""Stages 0, 1 and 2, composed from the shared pieces: ``FlatStage`` implements the ``Stage``
protocol (runtime/stage_protocol.py: what the engine, checkpoints and offload may ask of it).

Composition (no stage flags inside the pieces):

    stage | shards per flat buffer | GradReducer            | write-back
    ------+------------------------+------------------------+------------------------------
      0   | 1                      | AllReduceGrads         | copy master -> params
      1   | world size             | BoundaryReduceScatter  | copy to own shard, all-gather
      2   | world size             | PartitionedGrads       | copy to own shard, all-gather

The all-gather that follows the optimizer step (stages 1-2) is left in flight when ``step``
returns and completed by ``wait_params`` -- which the engine calls from a forward pre-hook on the
root module, so the next forward (train or eval) overlaps the gather's tail as FSDP2 does, and
before anything that reads the parameters through zerorun (state_dict, checkpoints, 16-bit
export, GatheredParameters, destroy). The pending gathers live here only (``FlatStage._gathers``).

Deferred write-backs (CPU optimizer offload whose step starts in the backward: the placement's
``may_defer``): the step may also return before the CPU has updated every flat buffer
(``placement.in_flight()``); the next forward then starts on the buffers it needs first while the
CPU steps the rest. Flat buffers are in gradient order (reverse registration), so the forward
uses them from the last to the first: buffer i's forward position is n - 1 - i. Forward
pre-hooks settle them (``_settle_upto``: wait for the CPU update, copy up ordered into the
stream, and -- stages 1-2 -- issue the buffer's all-gather; always every earlier pending buffer
first, so every rank issues the gathers in the same order whichever module asks) on:

* every module that stage 3 would make a group (``stage3.groups.group_modules``: by default
  the repeated blocks of a ModuleList/Sequential), for all parameters inside it -- the hook sits
  at the block's boundary, never inside a compiled block;
* every other module with parameters of its own (embeddings, final norm, head), for those;
* the root (the engine's forward pre-hook, ``before_forward``): the root's own parameters and
  those flagged ``zero.register_external_parameter`` -- a parameter read outside the modules
  that hold it must be registered, as at stage 3.

A parameter held by several modules (tied embedding / head) is settled by the first of them
that runs. A root forward post-hook settles whatever the forward did not use, so that after a
forward nothing is pending; the readers (``wait_params``) settle everything. Write-backs are
deferred only where settling one is local (stage 0, or one rank): at stages 1-2 with several
ranks settling a buffer would issue its all-gather, which every rank must issue, and a reader on
one rank alone (``if rank == 0: model.state_dict()``) between the step and the next forward
would hang; there the step settles everything and issues every gather before it returns.

Stage 3 (runtime/stage3/) implements the same protocol over its own parameter store.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerorun.runtime.collectives import Communicator, Pending
from zerorun.runtime.flat_params import FlatParamBuffers, TrainableParam
from zerorun.runtime.grad_reduce import (
    AllReduceGrads,
    BoundaryReduceScatter,
    GradReducer,
    PartitionedGrads,
)
from zerorun.runtime.optimizer import ELEMENTWISE
from zerorun.runtime.partition import FlatLayout
from zerorun.runtime.precision import MixedPrecisionPolicy
from zerorun.runtime.sharded_state import DevicePlacement, ShardedOptimizerState, ShardPlacement

__all__ = ["FlatStage", "build_flat_stage", "wait_all_params", "MAX_FLAT_NUMEL"]

_REDUCERS: dict[int, type[GradReducer]] = {0: AllReduceGrads, 1: BoundaryReduceScatter, 2: PartitionedGrads}

# Flat buffers hold at most this many elements, whatever reduce_bucket_size allows (DeepSpeed's
# default 5e8 would make a 1.3B model three buffers). A buffer is the unit of communication and
# of lazily allocated gradient memory, so smaller ones (a) start their reduce-scatter earlier in
# the backward and leave less of it exposed at the end, (b) bound stage 2's staging buffers
# (3 x 5e8 fp32 elements = 6 GB otherwise) and (c) let gradient memory appear gradually while
# activations are freed. 5e7 is one transformer block of 2048 hidden (FSDP2's unit here); NCCL
# runs messages of that size at full bandwidth. A parameter larger than this still gets a
# buffer of its own.
MAX_FLAT_NUMEL = 50_000_000
# The pipelined step (FlatStage.step) splits the buffers into about this many parts.
_STEP_PARTS = 8

# Every FlatStage alive in this process, for readers that hold parameters but no engine
# (zero.GatheredParameters on parameters of stages 0-2): ``wait_all_params``.
_LIVE: weakref.WeakSet[FlatStage] = weakref.WeakSet()


def wait_all_params() -> None:
    """Complete the parameter all-gather every live stage 0-2 left in flight after its step."""
    for stage in list(_LIVE):
        stage.wait_params()


class FlatStage:
    """Stages 0-2: parameters replicated as flat buffers, a reducer, a sharded optimizer state."""

    def __init__(
        self,
        stage: int,
        flat: FlatParamBuffers,
        reducer: GradReducer,
        state: ShardedOptimizerState,
        comm: Communicator,
        module: nn.Module | None = None,
    ) -> None:
        self.stage = stage
        self.flat = flat
        self.reducer = reducer
        self.state = state
        self.comm = comm
        self.grads_replicated = stage == 0
        self._shard = state.shard_index
        self._own = [flat.shard(i, self._shard) for i in range(len(flat.layouts))]  # views, made once
        self._parts: list[list[int]] | None = None  # decided at the first step (needs the optimizer)
        # The all-gather of the updated parameters, by flat buffer, issued at the end of step()
        # and completed by wait_params() (the next forward's pre-hooks, or a reader).
        self._gathers: dict[int, Pending] = {}
        self.deferred_gathers = 0  # steps that returned with the gather (or write-backs) in flight (tests)
        # Deferred write-backs (module docstring): buffers whose CPU update may still be running,
        # in forward order; _settle_upto settles them. _pos[i]: buffer i's forward position.
        n = len(flat.layouts)
        self._pos = [n - 1 - i for i in range(n)]
        self._unsettled: list[int] = []
        self._root_need = n  # forward position before_forward settles up to (all: no hooks)
        self._hooks: list[RemovableHandle] = []
        self.deferred_steps = 0  # steps that returned with write-backs in flight (tests)
        # Only where settling issues no collective (stage 0, one rank): at world > 1 a buffer's
        # all-gather could then only be issued when settled, and a rank-local reader between
        # step() and the next forward (`if rank == 0: model.state_dict()`, an eval forward on
        # rank 0) would issue it on one rank alone and hang. There the step settles every
        # buffer and issues all the gathers itself, as without offload.
        if module is not None and n and state.placement.may_defer and (stage == 0 or comm.world_size == 1):
            self._install_hooks(module)
            state.placement.deferrable = frozenset(range(n))
        _LIVE.add(self)

    def _install_hooks(self, root: nn.Module) -> None:
        """The forward pre-hooks that settle deferred write-backs (module docstring)."""
        from zerorun.runtime.stage3.groups import group_modules  # (stage3 imports this module)

        where = {id(p): i for i, ps in enumerate(self.flat.params) for p in ps}

        def need(params: list[nn.Parameter]) -> int:
            return max((self._pos[where[id(p)]] for p in params if id(p) in where), default=-1)

        blocks = [m for _path, m in group_modules(root, class_names=None, min_numel=0)]
        inside = {id(x) for b in blocks for x in b.modules()}
        units = [(b, list(b.parameters())) for b in blocks]
        units += [
            (m, list(m.parameters(recurse=False)))
            for m in root.modules()
            if m is not root and id(m) not in inside
        ]
        external = [p for p in root.parameters() if getattr(p, "_zerorun_external", False)]
        self._root_need = need(list(root.parameters(recurse=False)) + external)
        for m, params in units:
            k = need(params)
            if k > self._root_need:  # (what the root settles first needs no hook)
                self._hooks.append(m.register_forward_pre_hook(_eager(self._settle_hook(k))))
        self._hooks.append(root.register_forward_hook(_eager(lambda *_: self.wait_params())))

    def _settle_hook(self, need: int) -> Callable[..., None]:
        def hook(*_: object) -> None:
            if self._unsettled or self._gathers:
                self._settle_upto(need)

        return hook

    def _settle_upto(self, need: int) -> None:
        """Every deferred write-back of forward position <= ``need`` settled, in forward order
        (each buffer's all-gather issued right after it: the same order on every rank), then
        the all-gathers of those buffers waited for."""
        placement = self.state.placement
        while self._unsettled and self._pos[self._unsettled[0]] <= need:
            i = self._unsettled.pop(0)
            placement.settle(i)
            if self.stage > 0:
                with torch.no_grad():
                    self._gathers[i] = self.comm.all_gather(self.flat.buffers[i], self._own[i])
        for i in [i for i in self._gathers if self._pos[i] <= need]:
            self._gathers.pop(i).wait()

    @property
    def layouts(self) -> list[FlatLayout]:
        return self.flat.layouts

    def begin_backward(self, *, boundary: bool, first_micro: bool) -> None:
        self.reducer.begin(boundary=boundary, first_micro=first_micro)

    def expect_backward(self, *, boundary: bool, first_micro: bool) -> None:
        """What the next micro-step is, for a backward the engine does not see start (a script
        calling `loss.backward()` itself): the first gradient hook opens the reduction with it."""
        self.reducer.boundary = boundary
        self.reducer.first_micro = first_micro

    def end_backward(self) -> None:
        self.reducer.end_backward()

    def grad_shards(self) -> list[torch.Tensor]:
        return self.reducer.grad_shards()

    def step(self, grad_shards: Sequence[torch.Tensor]) -> None:
        """Optimizer step, write-back and the all-gather of the updated parameters -- issued,
        not waited for: ``wait_params`` completes it (the next forward does)."""
        self.wait_params()  # a step with no forward since the last one: shards still being read
        own = self._own
        if self._parts is None:
            self._parts = self._step_parts()
        if len(self._parts) > 1:
            # Pipelined: optimizer on one part of the buffers, its write-back, its all-gather
            # issued on the communication stream -- which then runs while the optimizer works on
            # the next part. The gathers still in flight at the end (at least the last part's)
            # overlap the next forward instead of ending the step.
            with torch.no_grad():
                for part in self._parts:
                    self.state.step(grad_shards, part)
                    self.state.write_back(own, part)
                    for i in part:
                        self._gathers[i] = self.comm.all_gather(self.flat.buffers[i], own[i])
        else:
            self.state.step(grad_shards)
            self._write_back()
        if self._gathers or self._unsettled:
            self.deferred_gathers += 1
        if self._unsettled:
            self.deferred_steps += 1

    def wait_params(self) -> None:
        """Complete the write-back left in flight by ``step``: afterwards the flat buffers (and
        so every parameter) hold the updated values, in the caller's stream order on CUDA.
        Cheap when nothing is pending. Every rank may call it independently (the collectives
        were issued already) -- unless write-backs were deferred (module docstring) at world
        > 1 and no forward ran since the step: settling them issues their all-gathers."""
        self._settle_upto(len(self._pos))

    def before_forward(self) -> None:
        """The engine's forward pre-hook on the root: what the per-module hooks do not settle
        (everything when there are none)."""
        self._settle_upto(self._root_need)

    @property
    def params_pending(self) -> bool:
        """True while the write-back of the last step is still owed a wait."""
        return bool(self._gathers or self._unsettled)

    def _write_back(self) -> None:
        """Masters -> this rank's parameter shards -> all-gather of the flat buffers (stages
        1-2), left in ``self._gathers``; the placement's deferred write-backs are left to
        ``_settle_upto``."""
        own = self._own
        with torch.no_grad():
            self.state.write_back(own)
            later = self.state.placement.in_flight()
            self._unsettled = sorted(later, key=self._pos.__getitem__)
            if self.stage > 0:
                for i, (buf, shard) in enumerate(zip(self.flat.buffers, own, strict=True)):
                    if i not in later:
                        self._gathers[i] = self.comm.all_gather(buf, shard)

    def params_from_masters(self) -> None:
        """After a checkpoint load: masters -> the flat parameter buffers. Collective; complete
        when it returns."""
        self.wait_params()
        self._write_back()
        self.wait_params()

    def _step_parts(self) -> list[list[int]]:
        """Parts of about equal size for the pipelined step, or one part (the plain step) when
        there is nothing to overlap (stage 0, one rank) or stepping parts is not provably the
        same step: an optimizer not known to be elementwise, or an offload placement (it
        schedules its own CPU work over the buffers)."""
        n = len(self.flat.layouts)
        optimizer = self.state.optimizer
        if (
            self.stage == 0
            or self.comm.trivial
            or n < 2
            or type(self.state.placement) is not DevicePlacement
            or optimizer is None
            or type(optimizer) not in ELEMENTWISE.values()
        ):
            return [list(range(n))]
        sizes = [layout.shard_numel for layout in self.flat.layouts]
        target = max(1, sum(sizes) // _STEP_PARTS)
        parts: list[list[int]] = [[]]
        filled = 0
        for i, size in enumerate(sizes):
            if filled >= target:
                parts.append([])
                filled = 0
            parts[-1].append(i)
            filled += size
        return parts

    def zero_grad(self) -> None:
        self.reducer.zero_grad()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {
            "params": list(self.flat.buffers),
            "grads": self.reducer.buffers(),
            "master": list(self.state.masters),
            "optimizer_states": self.state.optimizer_state_tensors(),
        }

    def buffer_peak_bytes(self) -> int:
        return self.reducer.peak_buffer_bytes

    def remove_hooks(self) -> None:
        self.wait_params()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.reducer.remove_hooks()


def build_flat_stage(
    stage: int,
    trainable: list[TrainableParam],
    *,
    policy: MixedPrecisionPolicy,
    comm: Communicator,
    device: torch.device,
    bucket_numel: int,
    placement: ShardPlacement,
    module: nn.Module | None = None,
) -> FlatStage:
    """Flatten ``trainable`` into flat buffers (compute dtype), bind the parameters to them and
    create the master shards from the original fp32 values. ``module``: the model, for the
    forward pre-hooks of deferred write-backs (module docstring)."""
    if stage not in _REDUCERS:
        raise ValueError(f"build_flat_stage handles stages 0-2, not {stage}")
    num_shards = 1 if stage == 0 else comm.world_size
    shard = 0 if stage == 0 else comm.rank
    originals: dict[str, torch.Tensor] = {t.name: t.param.detach() for t in trainable}
    flat = FlatParamBuffers(
        trainable,
        param_dtype=policy.param_dtype,
        device=device,
        num_shards=num_shards,
        bucket_numel=min(bucket_numel, MAX_FLAT_NUMEL),
    )
    fp32_init: Callable[[int], torch.Tensor] = lambda i: flat.fp32_shard_from(i, shard, originals)  # noqa: E731
    state = ShardedOptimizerState(
        flat.layouts,
        shard,
        [flat.shard(i, shard) for i in range(len(flat.layouts))],
        fp32_init,
        placement,
    )
    flat.bind()
    reducer = _REDUCERS[stage](flat, comm, policy.reduce_dtype)
    # A reduced gradient final during backward goes to the placement at once (offload may start
    # the CPU step there; the default placement ignores it).
    reducer.on_grad_ready = lambda i: state.grad_ready(i, reducer.grad_shard(i))
    return FlatStage(stage, flat, reducer, state, comm, module)


def _eager(fn: Callable[..., None]) -> Callable[..., None]:
    """A hook that runs eagerly also when called from compiled code (as the engine's)."""
    return torch._disable_dynamo(fn, recursive=True)
