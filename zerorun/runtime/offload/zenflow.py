"""ZenFlow (``zero_optimization.zenflow``): selective updates with CPU optimizer offload. Changes
the math (docs/offload.md).

zerorun's rule, per flat buffer shard of this rank (masters and Adam states on the host, as with
plain CPU offload):

* columns: a parameter of two or more dimensions is seen as ``[numel / C, C]`` (C its last
  dimension); column j is every element whose index is j mod C. One-dimensional parameters
  (biases, norms) are always "important".
* selection: at the first selective step and every ``select_interval`` steps after it, the
  ``ceil(topk_ratio * C)`` columns with the largest squared gradient norm (this step's clipped
  gradient, over the rows this rank holds) become the important ones of each parameter.
* every step, the important elements are updated by Adam(W) **on the training device**, from
  compact device copies of their master, m and v, with a step counter of their own; the 16-bit
  parameter gets them at once.
* the other elements' gradients are summed on the device; every ``update_interval`` steps (and
  at a re-selection) their mean over the k steps summed is copied to the host and the CPU steps
  them with Adam(W) -- one step, the host states' own counter, learning rate k times the
  group's (so that on average they move as fast as with a step each: Adam's step size does not
  grow with the gradient) -- then they are copied up as with plain offload.
* at a re-selection, the compact device states go back into the host arrays and the new
  important ones are gathered from them (an element keeps its m and v; the bias correction
  uses the counter of the side it is on).
* ``full_warm_up_rounds``: that many plain offloaded (exact) steps first.

Checkpoints hold the masters and Adam states after folding the device part back
(``synchronize``), and the open update interval: ``synchronize`` also puts, into each master's
optimizer state, the interval's gradient sum (``zenflow_grad_sum``) and the important elements
(``zenflow_important``, 1.0/0.0) -- elementwise, so checkpoints save and reshard them like Adam's
m and v -- and the counters (``zenflow_*`` scalars). A load hands them back (``state_loaded``):
the run continues inside the same interval, with the same important elements and counters, as if
never interrupted. The next step drops these entries from the optimizer's state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from zerorun.runtime.offload.adam import adam_tile, hyper_of, supports_tiles
from zerorun.runtime.offload.cpu import CpuPlacement
from zerorun.runtime.offload.host_placement import warn_once
from zerorun.runtime.partition import FlatLayout

__all__ = ["ZenFlowPlacement", "column_pieces"]

# (start, end) in the shard, the parameter's column count C (0: one-dimensional, always
# important), the offset of `start` inside the parameter's flattened values.
Piece = tuple[int, int, int, int]


def column_pieces(layout: FlatLayout, shard_index: int) -> list[Piece]:
    start, end = layout.shard_range(shard_index)
    out: list[Piece] = []
    for slot, lo, hi in layout.pieces_in_range(start, end):
        shape = tuple(slot.shape)
        cols = int(shape[-1]) if len(shape) >= 2 else 0
        a = slot.offset + lo - start
        out.append((a, a + (hi - lo), cols, lo))
    return out


def select_mask(grad: torch.Tensor, pieces: Sequence[Piece], topk_ratio: float) -> torch.Tensor:
    """Important elements of one shard (bool, on the gradient's device)."""
    mask = torch.zeros(grad.numel(), dtype=torch.bool, device=grad.device)
    for a, b, cols, lo in pieces:
        if cols == 0:
            mask[a:b] = True
            continue
        seg = grad[a:b].float()
        col = (torch.arange(lo, lo + (b - a), device=grad.device) % cols)
        score = torch.zeros(cols, dtype=torch.float32, device=grad.device).index_add_(0, col, seg * seg)
        k = min(cols, max(1, math.ceil(topk_ratio * cols)))
        chosen = torch.zeros(cols, dtype=torch.bool, device=grad.device)
        chosen[torch.topk(score, k).indices] = True
        mask[a:b] = chosen[col]
    return mask


class ZenFlowPlacement(CpuPlacement):
    name = "zenflow"
    partial_ok = False
    narrow_ok = False  # the host takes interval sums (fp32), not one step's gradient

    def __init__(self, opts: Any, device: torch.device) -> None:
        super().__init__(opts, device)
        zf = opts.zenflow
        assert zf is not None
        self.zf = zf
        self._pieces: list[list[Piece]] = []
        self._gdev: dict[int, torch.Tensor] = {}
        self._acc: list[torch.Tensor | None] = []  # device sums of the gradients since the last CPU update
        self._count = 0  # steps summed into _acc
        self._idx: list[torch.Tensor | None] = []  # important elements (device, sorted)
        self._fast: list[dict[str, torch.Tensor] | None] = []  # compact device master/m/v of them
        self._fast_step: list[torch.Tensor | None] = []
        self.zf_steps = 0  # selective steps taken
        self.cpu_updates = 0  # CPU updates of the unimportant elements
        self.selections = 0
        self._slow_now = False
        self._carried = False  # a checkpoint load brought an open interval (state_loaded)

    # -- layout ---------------------------------------------------------------------------------
    def plan(self, numels: Sequence[int], layouts: Sequence[FlatLayout] | None = None, shard_index: int = 0) -> None:
        super().plan(numels, layouts, shard_index)
        assert layouts is not None, "ZenFlow needs the flat layouts"
        self._pieces = [column_pieces(layout, shard_index) for layout in layouts]
        n = len(layouts)
        self._acc, self._idx, self._fast, self._fast_step = [None] * n, [None] * n, [None] * n, [None] * n

    # -- the step -------------------------------------------------------------------------------
    @property
    def _selective(self) -> bool:
        return self.steps >= self.zf.warmup

    def grad_ready(self, index: int, grad_shard: torch.Tensor, optimizer: Optimizer | None) -> None:
        if not self._selective:
            super().grad_ready(index, grad_shard, optimizer)

    def grad_for_step(self, index: int, grad_shard: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        if not self._selective:
            return super().grad_for_step(index, grad_shard, master)
        self._in_step = True
        self._gdev[index] = grad_shard
        return self.grads[index]

    def before_step(self) -> None:
        if not self._selective:
            super().before_step()

    def _step(self, optimizer: Optimizer) -> None:
        self._optimizer = optimizer
        self._group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self._carried = False
        self._take_carried(optimizer)  # what a synchronize put there for a checkpoint: stale now
        if not self._selective or not supports_tiles(optimizer):
            if self._selective:
                warn_once(f"zenflow: {type(optimizer).__name__} is not supported (Adam and AdamW are); exact steps")
            super()._step(optimizer)
            return
        first = self._idx[0] is None if self._idx else True
        interval = self.zf.select_interval
        reselect = not first and interval > 0 and self.zf_steps % interval == 0
        if first:
            self._select()
        elif reselect:
            # The interval's sum is applied before the sets change; the device part goes back to
            # the host, and the whole host master is copied up (write_back) before the new
            # important elements are written over it (after_write_back).
            self._cpu_update(optimizer, push=False)
            self._fold_back()
            self._fresh = [True] * len(self.masters)
            self._slow_now = True
            self._select()
        self._fast_update(optimizer)
        self._accumulate()
        self.zf_steps += 1
        self.steps += 1
        if self._count >= self.zf.update_interval:
            self._slow_now = True
            self._cpu_update(optimizer, push=True)

    def _select(self) -> None:
        self.selections += 1
        for i in range(len(self.masters)):
            g = self._gdev[i].reshape(-1)
            self._gather(i, select_mask(g, self._pieces[i], self.zf.topk_ratio).nonzero().squeeze(1))

    def _gather(self, i: int, idx: torch.Tensor) -> None:
        """The important elements ``idx`` of shard ``i``: compact device copies of their master
        and Adam states, from the host arrays."""
        master = self.masters[i]
        self._idx[i] = idx
        host_idx = idx.cpu()
        state = self._host_state(i)
        self._fast[i] = {
            "param": master[host_idx].to(self.device),
            "exp_avg": state["exp_avg"][host_idx].to(self.device),
            "exp_avg_sq": state["exp_avg_sq"][host_idx].to(self.device),
        }
        if self._fast_step[i] is None:
            self._fast_step[i] = state["step"].clone().to(self.device)

    def _host_state(self, i: int) -> dict[str, torch.Tensor]:
        assert self._optimizer is not None
        from zerorun.runtime.offload.adam import ensure_state

        group = self._group_of[id(self.masters[i])]
        h = hyper_of(self._optimizer, group)
        return ensure_state(self._optimizer, self.masters[i], h, make=lambda key, i=i: self._state_tensor(i, key))

    def _fold_back(self) -> None:
        """The compact device part back into the host master and states."""
        for i, master in enumerate(self.masters):
            fast, idx = self._fast[i], self._idx[i]
            if fast is None or idx is None:
                continue
            host_idx = idx.cpu()
            state = self._host_state(i)
            with torch.no_grad():
                master[host_idx] = fast["param"].cpu()
                state["exp_avg"][host_idx] = fast["exp_avg"].cpu()
                state["exp_avg_sq"][host_idx] = fast["exp_avg_sq"].cpu()

    def _fast_update(self, optimizer: Optimizer) -> None:
        with torch.no_grad():
            for i in range(len(self.masters)):
                fast, idx, step = self._fast[i], self._idx[i], self._fast_step[i]
                assert fast is not None and idx is not None and step is not None
                h = hyper_of(optimizer, self._group_of[id(self.masters[i])])
                step += 1
                g = self._gdev[i].reshape(-1)[idx].float()
                adam_tile(fast["param"], g, fast["exp_avg"], fast["exp_avg_sq"], None, step, h)

    def _accumulate(self) -> None:
        with torch.no_grad():
            for i in range(len(self.masters)):
                g = self._gdev[i].reshape(-1)
                acc = self._acc[i]
                if acc is None:
                    self._acc[i] = acc = torch.zeros(g.numel(), dtype=torch.float32, device=g.device)
                acc.add_(g)
        self._count += 1

    def _cpu_update(self, optimizer: Optimizer, *, push: bool) -> None:
        """The unimportant elements: the mean of the summed gradients, one CPU Adam step at k
        times the learning rate for k summed steps (the important ones are stepped too,
        harmlessly: their host values are overwritten from the device part when it folds back,
        and never read before)."""
        if self._count == 0:
            return
        for acc in self._acc:
            assert acc is not None
            acc.div_(self._count)
        # The copies down start after this event: recorded after the divisions (on CUDA an
        # event recorded before them let a copy read the sum instead of the mean -- a race that
        # made GPU runs differ from run to run; the CPU's synchronous copies never showed it).
        self._ready = self.copier.ready()
        for i, acc in enumerate(self._acc):
            assert acc is not None
            self._copy_down(i, acc)
        self.copier.fence(self._last_down)
        job = self._prepare(optimizer, True)
        k = self._count
        job.hypers = [None if h is None else dataclasses.replace(h, lr=h.lr * k) for h in job.hypers]
        self.runner.run(lambda: self._update(job, push=push))
        for acc in self._acc:
            if acc is not None:
                acc.zero_()
        self._count = 0
        self.cpu_updates += 1

    def write_back(self, index: int, master: torch.Tensor, dst: torch.Tensor) -> None:
        if not self._in_step:
            # Outside a step (a checkpoint load): the host masters and states are the truth;
            # the next selective step selects and gathers afresh -- unless the load carried an
            # open interval (state_loaded gathered its important elements from these masters).
            if not self._carried:
                self._idx = [None] * len(self._idx)
                self._fast = [None] * len(self._fast)
                self._fast_step = [None] * len(self._fast_step)
            super().write_back(index, master, dst)
            return
        if not self._selective or self._idx[index] is None:
            super().write_back(index, master, dst)
            return
        if self._slow_now:
            super().write_back(index, master, dst)  # the CPU update's tiles (copied up during the step)
        else:
            self._targets[index] = dst

    def after_write_back(self) -> None:
        super().after_write_back()  # (training stream waits for the copies up)
        if not self._gdev:
            return
        with torch.no_grad():
            for i, fast in enumerate(self._fast):
                dst, idx = self._targets.get(i), self._idx[i]
                if fast is None or dst is None or idx is None:
                    continue
                dst.reshape(-1).index_copy_(0, idx, fast["param"].to(dst.dtype))
        self._gdev = {}
        self._slow_now = False

    def synchronize(self) -> None:
        super().synchronize()
        self._fold_back()
        self._carry()

    # -- checkpoints: the open update interval travels in the optimizer's state -------------------
    def _carry(self) -> None:
        """Put the interval's state into each master's optimizer state (module docstring)."""
        if self._optimizer is None:
            return  # no step yet: nothing to carry
        # 0-dim tensors: the checkpoint keeps them as the group's scalar state (like Adam's step).
        counters = {
            k: torch.tensor(float(v))
            for k, v in (
                ("zenflow_placement_steps", self.steps),
                ("zenflow_steps", self.zf_steps),
                ("zenflow_count", self._count),
                ("zenflow_selections", self.selections),
                ("zenflow_cpu_updates", self.cpu_updates),
            )
        }
        for i, master in enumerate(self.masters):
            state = self._host_state(i)
            state.update(counters)
            idx, step = self._idx[i], self._fast_step[i]
            if idx is None or step is None:
                continue
            state["zenflow_fast_step"] = step.detach().to("cpu", torch.float32).clone()
            mask = torch.zeros(master.numel(), dtype=torch.float32)
            mask[idx.cpu()] = 1.0
            state["zenflow_important"] = mask
            acc = self._acc[i]
            state["zenflow_grad_sum"] = torch.zeros_like(master) if acc is None else acc.to("cpu", torch.float32)

    def _take_carried(self, optimizer: Optimizer) -> list[dict[str, Any]]:
        """Remove the carried entries from every master's optimizer state; return them."""
        out = []
        for master in self.masters:
            state = optimizer.state.get(master, {})
            out.append({k: state.pop(k) for k in [k for k in state if str(k).startswith("zenflow_")]})
        return out

    def state_loaded(self, optimizer: Optimizer) -> None:
        super().state_loaded(optimizer)
        self._optimizer = optimizer
        self._group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        carried = self._take_carried(optimizer)
        n = len(self.masters)
        self._idx, self._fast, self._fast_step, self._acc = [None] * n, [None] * n, [None] * n, [None] * n
        self._count, self._carried = 0, False
        first = carried[0] if carried else {}
        if "zenflow_steps" not in first:
            return  # a checkpoint without ZenFlow's state: select afresh at the next selective step
        self.steps = int(first["zenflow_placement_steps"])
        self.zf_steps = int(first["zenflow_steps"])
        self._count = int(first["zenflow_count"])
        self.selections = int(first["zenflow_selections"])
        self.cpu_updates = int(first["zenflow_cpu_updates"])
        for i, c in enumerate(carried):
            if "zenflow_important" not in c:
                continue
            idx = c["zenflow_important"].reshape(-1).nonzero().squeeze(1).to(self.device)
            self._fast_step[i] = torch.tensor(float(c["zenflow_fast_step"]), device=self.device)
            self._gather(i, idx)
            self._acc[i] = c["zenflow_grad_sum"].reshape(-1).to(self.device, torch.float32).clone()
        self._carried = True

    def add_memory(self, ledger: Any) -> None:
        super().add_memory(ledger)
        ledger.add("grads", [a for a in self._acc if a is not None])  # the interval's gradient sums
        ledger.add("master", [f["param"] for f in self._fast if f is not None])
        ledger.add("optimizer_states", [f[k] for f in self._fast if f is not None for k in ("exp_avg", "exp_avg_sq")])

    _optimizer: Optimizer | None = None
    _group_of: dict[int, dict[str, Any]] = {}  # noqa: RUF012

