"""Execution-order recording and the prefetch / keep decisions of stage 3.

The order in which groups run is recorded every forward and every backward; the previous
pass's order predicts the next one. While group ``g`` runs at position ``k`` of the current
pass and the previous pass also had ``g`` at ``k``, the groups that followed it last time are
prefetched (their all-gathers issued now, so they overlap ``g``'s compute). When the order
changes (data-dependent control flow) the prediction simply stops matching: nothing is
prefetched until it matches again, and every group is still gathered on demand -- correctness
never depends on the prediction. The first backward is predicted as the reverse of the order in
which groups finished their forward.

Limits (DeepSpeed's keys, in elements of the compute dtype):

* ``stage3_prefetch_bucket_size`` -- prefetching stops once this many elements are in flight
  ahead of the current group (the first group is always allowed, as in DeepSpeed);
* ``stage3_max_live_parameters`` -- no prefetch may bring the gathered total above this; a group
  needed *now* is always gathered, so at most this plus one group is ever alive;
* ``stage3_max_reuse_distance`` -- after its forward a group stays gathered if fewer than this
  many elements are gathered before it runs again (e.g. the last blocks, which the backward needs
  first); 0 keeps nothing (DeepSpeed's reading). Only with several ranks (hooks.py): with one
  there is no communication to save.
"""

from __future__ import annotations

from collections.abc import Sequence

from zerorun.runtime.stage3.param_group import RELEASED, ParamGroup

__all__ = ["Schedule"]


class Schedule:
    def __init__(
        self,
        groups: Sequence[ParamGroup],
        *,
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_distance: int,
    ) -> None:
        self.groups = list(groups)
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        self.fwd_prev: list[int] = []
        self.fwd_cur: list[int] = []
        self.post_cur: list[int] = []  # order in which groups *finished* their forward
        self.last_grad_post: list[int] = []
        self.bwd_prev: list[int] = []
        self.bwd_cur: list[int] = []
        # Counters tests and the memory summary read.
        self.prefetches = 0
        self.prefetch_hits = 0  # a group found already gathering/gathered when needed
        self.peak_live_numel = 0

    # -- passes ---------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        if self.fwd_cur:
            self.fwd_prev = self.fwd_cur
        self.fwd_cur = []
        self.post_cur = []

    def end_forward(self, grad: bool) -> None:
        if grad:
            self.last_grad_post = list(self.post_cur)

    def on_post_forward(self, g: ParamGroup) -> None:
        self.post_cur.append(g.index)

    def begin_backward(self) -> None:
        self.bwd_cur = []

    def end_backward(self) -> None:
        if self.bwd_cur:
            self.bwd_prev = self.bwd_cur
        self.bwd_cur = []

    # -- events ---------------------------------------------------------------------------------
    def on_forward(self, g: ParamGroup) -> list[int]:
        """Record ``g`` and return the predicted groups that follow it in this forward."""
        pos = len(self.fwd_cur)
        self.fwd_cur.append(g.index)
        return self._upcoming(self.fwd_prev, pos, g.index)

    def on_backward(self, g: ParamGroup) -> list[int]:
        pos = len(self.bwd_cur)
        self.bwd_cur.append(g.index)
        # Pre-backward hooks fire in the reverse order of forward *completion* (FSDP2's guess).
        predicted = self.bwd_prev or list(reversed(self.last_grad_post or self.post_cur))
        return self._upcoming(predicted, pos, g.index)

    @staticmethod
    def _upcoming(predicted: Sequence[int], pos: int, current: int) -> list[int]:
        if pos < len(predicted) and predicted[pos] == current:
            return list(predicted[pos + 1 :])
        return []

    # -- decisions ------------------------------------------------------------------------------
    def live_numel(self) -> int:
        return sum(g.numel for g in self.groups if g.live)

    def note_live(self) -> None:
        live = self.live_numel()
        if live > self.peak_live_numel:
            self.peak_live_numel = live

    def prefetch(self, current: ParamGroup, upcoming: Sequence[int]) -> None:
        if self.prefetch_numel <= 0 or not current.prefetch_pays:
            self.note_live()
            return
        ahead = 0
        seen = {current.index}
        live = self.live_numel()
        for gi in upcoming:
            if ahead >= self.prefetch_numel:
                break
            if gi in seen:
                continue
            seen.add(gi)
            g = self.groups[gi]
            if g.resident:
                continue
            if g.state != RELEASED:
                ahead += g.numel
                continue
            if live + g.numel > self.max_live_numel:
                break
            g.gather_async()
            self.prefetches += 1
            live += g.numel
            ahead += g.numel
        self.note_live()

    def keep_after_forward(self, g: ParamGroup) -> bool:
        """Will ``g`` run again before ``stage3_max_reuse_distance`` elements are gathered? Looks
        at the rest of this forward as predicted, then the backward (reverse order)."""
        pos = len(self.fwd_cur) - 1
        if not (pos < len(self.fwd_prev) and self.fwd_prev[pos] == g.index):
            return False
        distance = 0
        rest = self.fwd_prev[pos + 1 :]
        for gi in rest:
            if gi == g.index:
                return distance < self.max_reuse_distance
            distance += self.groups[gi].numel
        # The backward runs the groups after g again (reverse order) before reaching g.
        return 2 * distance < self.max_reuse_distance
