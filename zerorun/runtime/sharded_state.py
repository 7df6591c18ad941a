"""The sharded optimizer state that stages 1, 2 and 3 share (stage 0 uses it with one shard).

Per flat buffer this rank owns one shard; for each it keeps an fp32 **master shard** that the
torch optimizer updates as if it were a parameter, so optimizer states exist only for this
rank's shards. One step is:

    grads = stage's reduced gradient shards (reduce dtype)
    state.step(grads)         # placement brings grads to the masters, optimizer.step()
    state.write_back(dsts)    # updated masters -> the stage's 16-bit parameter shards

Where masters and optimizer states live is the ``ShardPlacement``'s business, not the stage's:
the default keeps them on the training device (a master shard is simply a view of the parameter
shard when both are fp32, so fp32 training keeps no extra copy). ``zerorun.runtime.offload``
provides placements for pinned CPU memory / NVMe; nothing else here knows about offload.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from zerorun.runtime.memory import MemoryLedger
from zerorun.runtime.observe.timers import PhaseSource
from zerorun.runtime.partition import FlatLayout

__all__ = ["ShardPlacement", "DevicePlacement", "ShardedOptimizerState", "ParamShardStore"]


class ParamShardStore:
    """Where stage 3 keeps the at-rest shard of each partitioned flat buffer (the parameter
    placement seam; stage3/param_store.py: DeviceParamStore, offload/params.py: HostParamStore).
    docs/architecture.md, Contract 6 "Stage 3 parameter placement"."""

    #: True when ``fetch`` returns the at-rest shard itself (it lives on the training device).
    #: With one rank such a shard *is* the whole flat buffer, so stage 3 binds the parameters to
    #: it for good and never gathers or releases (no copy at all).
    resident: bool = False

    def allocate(self, key: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def fetch(self, key: int, shard: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def release(self, key: int, fetched: torch.Tensor) -> None:
        return None

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def add_memory(self, ledger: MemoryLedger) -> None:
        """Bytes held beyond ``tensors()`` (host buffers, files), for ``engine.memory_summary``."""
        return None

    def close(self) -> None:
        """Release what the store holds (``engine.destroy``)."""
        return None


class ShardPlacement:
    """Decides where master shards and optimizer states live and moves data to/from them.

    Subclass contract (offload implements these):
      * ``make_master(i, param_shard, fp32_init)`` returns the fp32 master for flat buffer ``i``
        (``fp32_init()`` gives the shard's initial fp32 values; call it only if a copy is needed).
      * ``grad_for_step(i, grad_shard, master)`` returns the gradient the optimizer should see,
        on the master's device and dtype (may start an async copy).
      * ``before_step()`` waits for those copies; ``step(optimizer)`` runs the optimizer.
      * ``write_back(i, master, dst)`` copies an updated master into the stage's parameter shard
        ``dst`` (16-bit, on the training device); ``after_write_back()`` completes such copies.
    """

    name = "base"
    #: Stage 3 keeps its at-rest parameter shards in this store when set (parameter offload:
    #: ``offload.placement_for`` sets it); None: ``DeviceParamStore`` on the training device.
    param_store: ParamShardStore | None = None

    def make_master(
        self, index: int, param_shard: torch.Tensor, fp32_init: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        raise NotImplementedError

    def grad_for_step(self, index: int, grad_shard: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def before_step(self) -> None:
        return None

    def step(self, optimizer: Optimizer) -> None:
        optimizer.step()

    def write_back(self, index: int, master: torch.Tensor, dst: torch.Tensor) -> None:
        raise NotImplementedError

    def after_write_back(self) -> None:
        return None

    # Generic hooks with no-op defaults (an offload placement uses them):
    def plan(self, numels: Sequence[int], layouts: Sequence[FlatLayout] | None = None, shard_index: int = 0) -> None:
        """The shard sizes of every flat buffer (and the layouts, this rank's shard index),
        before the first ``make_master``: a partial offload decides here which masters stay on
        the device, ZenFlow learns the parameters' columns."""
        return None

    def grad_ready(self, index: int, grad_shard: torch.Tensor, optimizer: Optimizer | None) -> None:
        """Flat buffer ``index``'s reduced gradient shard is final for this step, during
        backward, ordered into the caller's stream (the stage calls it when it can; it may not).
        A placement may start copying it, and stepping it when the step needs no global norm."""
        return None

    def synchronize(self) -> None:
        """Complete optimizer work still in flight (a delayed CPU step), so that masters and
        optimizer states are current. Called before anything reads or replaces them."""
        return None

    # Deferred write-backs (docs/architecture.md, Contract 6 "deferred write-backs"): the stage
    # lists the flat buffers it settles before anything reads their destination; the placement
    # may then return from ``step`` with those write-backs still in flight.
    @property
    def may_defer(self) -> bool:
        """Can this placement leave write-backs in flight at all (a stage installs its settle
        hooks only then)?"""
        return False

    #: Set by the stage: buffers whose write-back may complete after the step returns.
    deferrable: frozenset[int] = frozenset()
    #: Set by the stage (optional): the deferrable buffers in the order the next forward first
    #: reads them, so the placement completes them in that order (stage 3: its persistent
    #: group, read by every module, first). Empty: the reverse of the order the gradients are
    #: final in the backward.
    settle_order: tuple[int, ...] = ()

    def in_flight(self) -> frozenset[int]:
        """Buffers whose write-back the last step left in flight (a subset of ``deferrable``;
        the same on every rank: decided from the config and the step count only)."""
        return frozenset()

    def settle(self, index: int) -> None:
        """Buffer ``index``'s write-back complete (its destination holds the update, in the
        caller's stream order on CUDA); training thread. Not collective; cheap when nothing is
        pending."""
        return None

    def settle_all(self) -> None:
        """Every deferred write-back complete (``settle`` for each)."""
        return None

    def close(self) -> None:
        """Release threads/files (engine.destroy)."""
        return None

    def add_memory(self, ledger: MemoryLedger) -> None:
        """Add what the placement holds besides masters and optimizer states (host gradient and
        staging buffers, bytes on NVMe) to a ``memory.MemoryLedger``."""
        return None

    def state_loaded(self, optimizer: Optimizer) -> None:
        """The masters and the optimizer's state were just replaced (a checkpoint load), before
        the parameters are written from the masters (``write_back`` outside a step). A placement
        with state of its own carried in the optimizer's state (ZenFlow) takes it back here."""
        return None

    def phase_timer(self) -> PhaseSource | None:
        """``wall_clock_breakdown``: start timing this placement's own sub-phases and return
        what the step timers call after each optimizer step for that step's (name -> ms or
        (begin, end) marks; observe/timers.py); None when it has none (offload has: copies,
        the CPU step, waits)."""
        return None

    @property
    def optimizer_device(self) -> torch.device:
        raise NotImplementedError


class DevicePlacement(ShardPlacement):
    """Masters and optimizer states on the training device."""

    name = "device"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def make_master(
        self, index: int, param_shard: torch.Tensor, fp32_init: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        if param_shard.dtype == torch.float32:
            return param_shard  # fp32 training: the parameter shard is the master, no copy
        return fp32_init().to(self.device, torch.float32)

    def grad_for_step(self, index: int, grad_shard: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        return grad_shard if grad_shard.dtype == master.dtype else grad_shard.to(master.dtype)

    def write_back(self, index: int, master: torch.Tensor, dst: torch.Tensor) -> None:
        if master.data_ptr() != dst.data_ptr():
            dst.copy_(master)

    @property
    def optimizer_device(self) -> torch.device:
        return self.device


class ShardedOptimizerState:
    """Master shards (one per flat buffer) + the torch optimizer over them + partition metadata."""

    def __init__(
        self,
        layouts: Sequence[FlatLayout],
        shard_index: int,
        param_shards: Sequence[torch.Tensor],
        fp32_init: Callable[[int], torch.Tensor],
        placement: ShardPlacement,
    ) -> None:
        layouts = list(layouts)
        placement.plan([p.numel() for p in param_shards], layouts, shard_index)
        masters = [
            placement.make_master(i, param_shards[i], functools.partial(fp32_init, i))
            for i in range(len(layouts))
        ]
        self._adopt(layouts, shard_index, masters, placement)

    @classmethod
    def from_masters(
        cls,
        layouts: Sequence[FlatLayout],
        shard_index: int,
        masters: Sequence[torch.Tensor],
        placement: ShardPlacement,
    ) -> ShardedOptimizerState:
        """Adopt masters the caller already made with ``placement.make_master`` (index order,
        after ``placement.plan`` over every layout's shard size). Stage 3 makes each group's
        masters while it builds the group, so that the fp32 initial values of one group at a
        time exist besides the masters (stage3/build.py)."""
        state = cls.__new__(cls)
        state._adopt(list(layouts), shard_index, list(masters), placement)
        return state

    def _adopt(
        self,
        layouts: list[FlatLayout],
        shard_index: int,
        masters: list[torch.Tensor],
        placement: ShardPlacement,
    ) -> None:
        assert len(masters) == len(layouts)
        self.layouts = layouts
        self.shard_index = shard_index
        self.placement = placement
        self.masters: list[torch.Tensor] = masters
        self.optimizer: Optimizer | None = None

    def param_groups(self, group_hypers: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Param-group dicts over the masters, one per optimizer group (masters of a flat buffer
        belong to the buffer's group; a group with no trainable parameter keeps an empty list)."""
        groups = [dict(h, params=[]) for h in group_hypers]
        for layout, master in zip(self.layouts, self.masters, strict=True):
            groups[layout.group]["params"].append(master)
        return groups

    def attach(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer

    def synchronize(self) -> None:
        """Masters and optimizer states current (see ShardPlacement.synchronize)."""
        self.placement.synchronize()

    def grad_ready(self, index: int, grad_shard: torch.Tensor) -> None:
        self.placement.grad_ready(index, grad_shard, self.optimizer)

    def step(self, grad_shards: Sequence[torch.Tensor], indices: Sequence[int] | None = None) -> None:
        """The optimizer step on every master, or only on the masters of flat buffers
        ``indices`` (an elementwise torch optimizer skips parameters whose ``grad`` is None, so
        stepping a partition of the buffers one part at a time is the same step; a stage uses
        it to start one part's all-gather while the optimizer works on the next)."""
        assert self.optimizer is not None
        assert len(grad_shards) == len(self.masters)
        chosen = range(len(self.masters)) if indices is None else indices
        for i in chosen:
            master = self.masters[i]
            master.grad = self.placement.grad_for_step(i, grad_shards[i], master)
        self.placement.before_step()
        self.placement.step(self.optimizer)
        for i in chosen:
            self.masters[i].grad = None

    def write_back(self, dsts: Sequence[torch.Tensor], indices: Sequence[int] | None = None) -> None:
        assert len(dsts) == len(self.masters)
        for i in range(len(self.masters)) if indices is None else indices:
            self.placement.write_back(i, self.masters[i], dsts[i])
        self.placement.after_write_back()

    # -- exposure for checkpoints and memory accounting ---------------------------------------
    def optimizer_state_tensors(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        return [
            v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
        ]

    def sharded_state(self) -> dict[str, Any]:
        """What a sharded checkpoint stores for this rank: the partition metadata (enough to
        reshard: names, shapes, dtypes, offsets, shard ranges), the fp32 masters and the
        optimizer's per-master state in the same order."""
        assert self.optimizer is not None
        index = {id(m): i for i, m in enumerate(self.masters)}
        per_master: list[dict[str, Any]] = [{} for _ in self.masters]
        for p, s in self.optimizer.state.items():
            per_master[index[id(p)]] = dict(s)
        return {
            "layouts": [layout.to_dict() for layout in self.layouts],
            "shard_index": self.shard_index,
            "shard_ranges": [list(layout.shard_range(self.shard_index)) for layout in self.layouts],
            "masters": self.masters,
            "optimizer_state": per_master,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
            ],
        }

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        """Inverse of ``sharded_state`` for the same layouts and shard (resharding builds such a
        dict from other shards first)."""
        assert self.optimizer is not None
        with torch.no_grad():
            for master, src in zip(self.masters, state["masters"], strict=True):
                master.copy_(src)
        # Through torch's own load_state_dict, which casts/moves state the way the optimizer
        # class expects (e.g. fused Adam's step counters on the device).
        position = {id(m): i for i, m in enumerate(self.masters)}
        sd: dict[str, Any] = {"state": {}, "param_groups": []}
        k = 0
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
            ids = []
            for p in group["params"]:
                s = state["optimizer_state"][position[id(p)]]
                if s:
                    sd["state"][k] = s
                ids.append(k)
                k += 1
            sd["param_groups"].append(dict(saved, params=ids))
        self.optimizer.load_state_dict(sd)
        self.placement.state_loaded(self.optimizer)
