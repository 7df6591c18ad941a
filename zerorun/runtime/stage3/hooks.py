"""Forward/backward hooks that drive the groups: gather before use, release after, reduce-scatter
gradients right after a group's backward.

Per group module:

* forward pre-hook: record the order, prefetch what followed last time, gather (wait) this
  group; with grad enabled, wrap the tensor inputs in ``_PostBackward`` -- an identity whose
  backward runs once the gradients of the inputs are computed, i.e. after the whole backward of
  this call of the module (FSDP2's ``RegisterPostBackwardFunction``);
* forward post-hook: with grad enabled, register a multi-grad hook on the outputs -- it fires
  when the first output gradient arrives, *before* the module's backward ("pre-backward"), and
  gathers the group again (prefetching the next one); then release the group unless it is kept
  (root group, ``reshard_after_forward: false``, or reused soon, schedule.py);
* pre-backward: gather, record the backward order, prefetch;
* post-backward: when every call of the module in this forward has finished its backward (a
  module called twice reduces once), reduce-scatter the group's gradients and release it.

Whatever the hooks could not attribute (a call whose inputs needed no gradient, the root, the
persistent group, groups gathered by a recomputation) is finished by one callback queued on
the autograd engine at the first pre-backward, which runs when the backward ends -- also when
the script calls ``loss.backward()`` itself. Groups are reduced there in index order, the same
on every rank.

Inside a backward (``torch._C._current_graph_task_id() != -1``) a forward is a recomputation
(activation checkpointing): its hooks only make sure the group is gathered.

torch.compile: every hook runs eagerly (``torch._disable_dynamo``, as FSDP2's hooks do with
``torch._dynamo.config.skip_fsdp_hooks``). A compiled module's ``_call_impl`` (``block.compile()``)
or a whole compiled model calls them. Traced, they were cut into many small graphs (graph breaks
at the autograd.Function and the collectives: 42 for four blocks on CPU ranks), the gather and the
parameter rebinding (``p.data = view``) ran inside compiled frames whose guards saw parameters of
shape [0] one call and their real shape the next (recompiles up to dynamo's limit, as reported on
the GPU), and the first backward failed: "is at version 2; expected version 1" on a parameter the
compiled graph had saved. Run eagerly, a group's gather writes only its gather buffer
(``ParamGroup.full``), whose version counter the parameters do not share (``p.data = v`` keeps the
parameter's own counter), so what the compiled graph saved stays valid, and the compiled code only
ever sees gathered parameters of one shape: one compile for identical blocks
(tests/runtime/test_compile.py counts them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar, cast

import torch
from torch import nn
from torch.autograd.function import FunctionCtx
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from zerorun.errors import RuntimeConfigError
from zerorun.runtime.collectives import Pending
from zerorun.runtime.stage3.param_group import ParamGroup
from zerorun.runtime.stage3.schedule import Schedule

__all__ = ["Stage3Hooks"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
# What module hooks receive and return (positional args, keyword args, outputs: whatever the
# module takes and gives; only their tensors are looked at).
_Args = tuple[object, ...]
_Kwargs = dict[str, object]
_PreHook = Callable[[nn.Module, _Args, _Kwargs], tuple[_Args, _Kwargs] | None]
_PostHook = Callable[[nn.Module, _Args, object], None]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _eager(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` always runs eagerly, also when called from a compiled region (a graph break at
    the module boundary, never inside the module's own graph)."""

    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:  # a function: bound methods take no attributes
        return fn(*args, **kwargs)

    return cast(Callable[_P, _R], torch._disable_dynamo(call, recursive=True))


class _PostBackwardCtx(FunctionCtx):
    hooks: Stage3Hooks
    group: ParamGroup


class _PostBackward(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: _PostBackwardCtx, hooks: Stage3Hooks, group: ParamGroup, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.hooks = hooks
        ctx.group = group
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx: _PostBackwardCtx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        ctx.hooks.post_backward(ctx.group)
        return (None, None, *grads)


class _Calls:
    """Per-group bookkeeping of one forward/backward."""

    __slots__ = ("hooked", "unhooked", "fired", "reduced", "touched")

    def __init__(self) -> None:
        self.hooked = 0  # grad-enabled calls whose inputs carry a _PostBackward
        self.unhooked = 0  # grad-enabled calls without (inputs needed no gradient)
        self.fired = 0
        self.reduced = False
        self.touched = False  # gathered during the backward (pre-backward or recomputation)


class Stage3Hooks:

    def __init__(
        self,
        root: nn.Module,
        groups: Sequence[ParamGroup],
        schedule: Schedule,
        *,
        reshard_after_forward: bool,
        check_order: bool,
    ) -> None:
        self.root = root
        self.groups = list(groups)
        self.schedule = schedule
        self.reshard_after_forward = reshard_after_forward
        self.check_order = check_order
        self.calls = [_Calls() for _ in self.groups]
        # (flat buffer index, its gradient shard, the reduction in flight)
        self.pending: list[tuple[int, torch.Tensor, Pending]] = []
        # Called with (flat buffer index, gradient shard) once this rank's reduced gradient of
        # it is final for the step (accumulation boundary, collective completed): an offload
        # placement starts the CPU step there (Contract 6, ShardPlacement.grad_ready).
        self.on_grad_ready: Callable[[int, torch.Tensor], None] | None = None
        # Called at the end of each forward (not a recomputation): the optimizer placement's
        # write-backs the forward did not use settled (Stage3 sets it when they may be deferred).
        self.on_forward_end: Callable[[], None] | None = None
        self.boundary = True
        self.backward_open = False
        self.launches = 0  # reduce-scatters issued (tests assert overlap)
        self.launched_during_backward = 0
        self.peak_staging_bytes = 0
        self._staging_live = 0
        self._handles: list[RemovableHandle] = []
        self._root_group = next((g for g in self.groups if g.module is root and not g.persistent), None)
        for g in self.groups:
            if g.module is None or g.persistent:
                continue
            self._handles.append(
                g.module.register_forward_pre_hook(self._pre_forward_hook(g), with_kwargs=True, prepend=True)
            )
            self._handles.append(g.module.register_forward_hook(self._post_forward_hook(g), prepend=False))
        self._handles.append(root.register_forward_pre_hook(_eager(self._root_pre), prepend=True))
        self._handles.append(root.register_forward_hook(_eager(self._root_post)))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- root: one forward pass -------------------------------------------------------------------
    def _root_pre(self, _module: nn.Module, _args: _Args) -> None:
        if not _in_backward():
            self.schedule.begin_forward()

    def _root_post(self, _module: nn.Module, _args: _Args, output: object) -> None:
        if _in_backward():
            return
        grad = torch.is_grad_enabled()
        self.schedule.end_forward(grad)
        if self.on_forward_end is not None:
            self.on_forward_end()
        if grad:
            # Opens the backward bookkeeping (and queues its final callback) even when no
            # group's own pre-backward hook fires, e.g. a model with only persistent parameters.
            outs = [x for x in tree_flatten(output)[0] if torch.is_tensor(x) and x.requires_grad]
            if outs:
                register_multi_grad_hook(outs, _eager(lambda _grads: self._open_backward()), mode="any")
        if not grad:  # no backward follows: nothing stays gathered
            for g in self.groups:
                g.release()

    # -- group forward ----------------------------------------------------------------------------
    def _pre_forward_hook(self, g: ParamGroup) -> _PreHook:
        def hook(_module: nn.Module, args: _Args, kwargs: _Kwargs) -> tuple[_Args, _Kwargs] | None:
            if _in_backward():  # recomputation (activation checkpointing)
                self.calls[g.index].touched = True
                g.wait()
                self.schedule.note_live()
                return None
            if self.check_order:
                self._check_same_group(g, "forward")
            upcoming = self.schedule.on_forward(g)
            if g.live:
                self.schedule.prefetch_hits += 1  # gathered ahead (prefetched or kept)
            g.wait()
            self.schedule.prefetch(g, upcoming)
            if not torch.is_grad_enabled():
                return None
            calls = self.calls[g.index]
            flat, spec = tree_flatten((args, kwargs))
            idx = [i for i, x in enumerate(flat) if torch.is_tensor(x) and x.requires_grad]
            if not idx:
                calls.unhooked += 1
                return None
            calls.hooked += 1
            wrapped = _PostBackward.apply(self, g, *(flat[i] for i in idx))
            for i, w in zip(idx, wrapped, strict=True):
                flat[i] = w
            return cast(tuple[_Args, _Kwargs], tree_unflatten(flat, spec))

        return _eager(hook)

    def _post_forward_hook(self, g: ParamGroup) -> _PostHook:
        def hook(_module: nn.Module, _args: _Args, output: object) -> None:
            if _in_backward():
                return
            self.schedule.on_post_forward(g)
            if torch.is_grad_enabled():
                outs = [x for x in tree_flatten(output)[0] if torch.is_tensor(x) and x.requires_grad]
                if outs:
                    register_multi_grad_hook(outs, _eager(lambda _grads: self.pre_backward(g)), mode="any")
                if g is self._root_group or not self.reshard_after_forward:
                    return
                # One rank: re-gathering is a local cast-copy (no communication to save, with real
                # collectives too), keeping costs memory at the peak.
                if g.world > 1 and self.schedule.keep_after_forward(g):
                    return
            if g is not self._root_group:
                g.release()

        return _eager(hook)

    # -- backward -----------------------------------------------------------------------------------
    def _open_backward(self) -> None:
        if not self.backward_open:
            self.backward_open = True
            self.schedule.begin_backward()
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def pre_backward(self, g: ParamGroup) -> None:
        self._open_backward()
        if self.check_order:
            self._check_same_group(g, "backward")
        self.calls[g.index].touched = True
        upcoming = self.schedule.on_backward(g)
        if g.live:
            self.schedule.prefetch_hits += 1
        g.wait()
        self.schedule.prefetch(g, upcoming)

    def post_backward(self, g: ParamGroup) -> None:
        calls = self.calls[g.index]
        calls.fired += 1
        if calls.reduced or calls.unhooked or calls.fired < calls.hooked:
            return
        self._reduce(g)
        g.release()

    def finish_backward(self) -> None:
        """End of the backward (autograd's final callback): reduce what is left in group order,
        release everything, reset the per-pass bookkeeping."""
        if not self.backward_open:
            return
        for g, calls in zip(self.groups, self.calls, strict=True):
            if not calls.reduced and (calls.hooked or calls.unhooked or calls.touched or g.persistent):
                self._reduce(g)
        for g in self.groups:
            g.release()
        self.calls = [_Calls() for _ in self.groups]
        self.schedule.end_backward()
        self.backward_open = False

    def wait_reductions(self) -> None:
        while self.pending:
            self._retire()
        self._staging_live = 0

    def _retire(self) -> None:
        index, shard, pending = self.pending.pop(0)
        pending.wait()
        self._final(index, shard)

    def _final(self, index: int, shard: torch.Tensor) -> None:
        if self.boundary and self.on_grad_ready is not None:
            self.on_grad_ready(index, shard)

    def _reduce(self, g: ParamGroup) -> None:
        self.calls[g.index].reduced = True
        # The previous group's reductions are retired before this group's staging buffer is
        # filled (on CUDA an event wait, no host sync): one staging buffer alive at a time, as
        # FSDP2's one reduce-scatter input buffer; each reduction still overlaps the whole
        # backward of the next group.
        self.wait_reductions()
        issued = g.reduce_grads()
        if not issued:  # one rank: the gradient shards are written already
            for li, layout in enumerate(g.layouts):
                self._final(layout.index, g.grad_shard(li))
            return
        for li, (layout, p) in enumerate(zip(g.layouts, issued, strict=True)):
            shard = g.grad_shard(li)
            self.launches += 1
            if self.backward_open:
                self.launched_during_backward += 1
            self.pending.append((layout.index, shard, p))
        self._staging_live = g.staging_bytes() * len(issued)
        self.peak_staging_bytes = max(self.peak_staging_bytes, self._staging_live)

    # -- debug: same order on every rank --------------------------------------------------------
    def _check_same_group(self, g: ParamGroup, what: str) -> None:
        """Before a group is gathered on demand, check every rank is about to gather the same
        one (one tiny all-gather): ranks that diverge would otherwise exchange different groups'
        shards -- mixing weights silently, or crashing the backend when the sizes differ."""
        comm = g.comm
        if comm.world_size == 1:
            return
        mine = torch.tensor([g.index], dtype=torch.int64, device=comm.device)
        every = torch.empty(comm.world_size, dtype=torch.int64, device=comm.device)
        comm.all_gather(every, mine).wait()
        indices = every.tolist()  # host sync: debug option only
        if len(set(indices)) == 1:
            return
        done = self.schedule.fwd_cur if what == "forward" else self.schedule.bwd_cur
        so_far = " -> ".join(self.groups[i].name or "<root>" for i in done) or "(nothing yet)"
        lines = [f"  rank {r}: {self.groups[i].name or '<root>'}" for r, i in enumerate(indices)]
        raise RuntimeConfigError(
            f"ZeRO stage 3: ranks are about to gather different parameter groups in this {what} "
            f"(after {so_far}):\n" + "\n".join(lines) + "\nEvery rank must run the groups in the same "
            "order within a step (different orders mix weights or hang). Make data-dependent branches take "
            "the same path on every rank (e.g. decide from an all-reduced value), or move the branch's "
            "modules out of their own groups (zerorun.stage3_group_modules)."
        )
