"""The stage-3 stage object: the ``Stage`` protocol (runtime/stage_protocol.py) over parameter groups.

    begin_backward / end_backward    the hooks (hooks.py) reduce-scatter during the backward;
                                     end_backward finishes what is left and waits
    grad_shards()                    each flat buffer's reduced gradient shard (reduce dtype)
    step(grads)                      optimizer on the master shards, write-back into the at-rest
                                     parameter shards; the next forward gathers the new values
                                     (persistent parameters are all-gathered here)
    state / layouts / memory_tensors / buffer_peak_bytes / params_from_masters (checkpoints)
    remove_hooks()                   engine.destroy
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from zerorun.runtime.collectives import Communicator
from zerorun.runtime.partition import FlatLayout
from zerorun.runtime.sharded_state import ShardedOptimizerState
from zerorun.runtime.stage3.hooks import Stage3Hooks
from zerorun.runtime.stage3.param_group import ParamGroup
from zerorun.runtime.stage3.schedule import Schedule

__all__ = ["Stage3"]


class Stage3:
    stage = 3
    grads_replicated = False

    def __init__(
        self,
        groups: Sequence[ParamGroup],
        hooks: Stage3Hooks,
        schedule: Schedule,
        state: ShardedOptimizerState,
        comm: Communicator,
    ) -> None:
        self.groups = list(groups)
        self.hooks = hooks
        self.reducer = hooks  # the engine's destroy() removes hooks through this name
        self.schedule = schedule
        self.state = state
        self.comm = comm
        # flat buffer i (state.layouts order) -> (group, position of the layout in the group)
        self._owner: list[tuple[ParamGroup, int]] = [
            (g, li) for g in self.groups for li in range(len(g.layouts))
        ]
        hooks.on_grad_ready = state.grad_ready
        placement = state.placement
        # The persistent group's flat buffers whose write-back may be deferred too: at one rank
        # (its at-rest shard is the replica the modules read; refresh_replicas has nothing to
        # gather). With several ranks its replicas are all-gathered in the step: not deferred.
        self._persistent: tuple[int, ...] = ()
        if placement.may_defer:
            self._persistent = tuple(
                layout.index for g in self.groups if g.persistent and g.world == 1 for layout in g.layouts
            )
            # The step may leave the write-backs in flight: each group's gather (or, resident,
            # its forward) settles its shards first -- and the persistent group's, whose small
            # parameters any module may read (before_forward settles them too) --, the end of
            # the forward whatever it did not use, wait_params everything. The placement steps
            # them in that order (settle_order): the persistent group, then the groups in index
            # order (the root group, read from the start of the forward, then the blocks).
            placement.deferrable = frozenset(
                layout.index
                for g in self.groups
                if not g.persistent or g.world == 1
                for layout in g.layouts
            )
            placement.settle_order = self._persistent + tuple(
                layout.index for g in self.groups if not g.persistent for layout in g.layouts
            )
            settle = placement.settle
            if self._persistent:
                settle = functools.partial(_settle_after, placement.settle, self._persistent)
            for g in self.groups:
                g.before_read = settle
            hooks.on_forward_end = placement.settle_all
        # model_io's state_dict hooks on the module (build_stage3 installs them)
        self.io_handles: list[RemovableHandle] = []

    @property
    def layouts(self) -> list[FlatLayout]:
        return self.state.layouts

    # -- backward -------------------------------------------------------------------------------
    def begin_backward(self, *, boundary: bool, first_micro: bool) -> None:
        # Accumulation needs no flag here: a gradient shard is created by the first reduction
        # after zero_grad() and added to afterwards (ParamGroup.reduce_grads). The boundary tells
        # the hooks when a reduced shard is final (grad_ready for an offload placement).
        self.hooks.boundary = boundary

    def expect_backward(self, *, boundary: bool, first_micro: bool) -> None:
        """What the next micro-step is, for a backward the engine does not see start (a script
        calling `loss.backward()` itself)."""
        self.begin_backward(boundary=boundary, first_micro=first_micro)

    def end_backward(self) -> None:
        if self.hooks.backward_open:  # the final callback did not run (backward without hooks)
            self.hooks.finish_backward()
        self.hooks.wait_reductions()

    def grad_shards(self) -> list[torch.Tensor]:
        self.hooks.wait_reductions()
        return [g.grad_shard(li) for g, li in self._owner]

    # -- step -----------------------------------------------------------------------------------
    def release_all(self) -> None:
        for g in self.groups:
            g.release()

    def step(self, grad_shards: Sequence[torch.Tensor]) -> None:
        self.release_all()  # gathered copies would be stale after the update
        self.state.step(grad_shards)
        self._write_back()

    def _write_back(self) -> None:
        with torch.no_grad():
            self.state.write_back([g.at_rest[li] for g, li in self._owner])
            pending = [p for g in self.groups for p in g.refresh_replicas()]
            for p in pending:
                p.wait()

    def params_from_masters(self) -> None:
        """After a checkpoint load: masters -> at-rest shards (+ replicas). Collective."""
        self.release_all()
        self._write_back()

    def wait_params(self) -> None:
        """Write-backs the optimizer placement left in flight (CPU offload, step started in the
        backward) completed; the rest ``step`` completes itself (and the replicas' refresh)."""
        self.state.placement.settle_all()

    def before_forward(self) -> None:
        """The persistent group's deferred write-back (one rank), for a forward whose modules are
        not groups; each group settles its own shards (and the persistent ones) when the forward
        gathers (or uses) it."""
        if self._persistent:
            settle = self.state.placement.settle
            for index in self._persistent:
                settle(index)

    def zero_grad(self) -> None:
        for g in self.groups:
            g.zero_grad()

    def remove_hooks(self) -> None:
        self.hooks.remove_hooks()

    # -- memory ---------------------------------------------------------------------------------
    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """At-rest shards that are the fp32 masters count as ``master`` only (the ledger counts
        a storage once, in the first category that names it)."""
        masters = {m.untyped_storage().data_ptr() for m in self.state.masters}
        params: list[torch.Tensor] = []
        for g in self.groups:
            for t in g.full if g.resident else g.at_rest:
                if t.untyped_storage().data_ptr() not in masters or t.dtype == self.groups[0].dtype:
                    params.append(t)
        return {
            "params": params,
            "grads": [s for g in self.groups for s in g.grad_shards if s is not None],
            "master": list(self.state.masters),
            "optimizer_states": self.state.optimizer_state_tensors(),
        }

    def gathered_bytes(self) -> int:
        """Bytes of gathered (live) partitioned parameters right now."""
        return sum(g.nbytes for g in self.groups if g.live)

    def buffer_peak_bytes(self) -> int:
        """Peak gathered parameters (prefetched ones included) + peak gradient staging."""
        esize = torch.empty((), dtype=self.groups[0].dtype).element_size() if self.groups else 0
        return self.schedule.peak_live_numel * esize + self.hooks.peak_staging_bytes

    def group_of(self, p: torch.nn.Parameter) -> ParamGroup | None:
        return getattr(p, "_zerorun_group", None)


def _settle_after(settle: Callable[[int], None], first: tuple[int, ...], index: int) -> None:
    """``settle`` the persistent group's buffers ``first``, then flat buffer ``index`` (a group's
    read: its modules read persistent parameters too)."""
    for i in first:
        settle(i)
    settle(index)
