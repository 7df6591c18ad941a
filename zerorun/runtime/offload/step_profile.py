"""Where one offloaded step's time went, and the wall_clock_breakdown sub-phases made from it.

Seconds per key -- ``gradient_wait_s`` / ``io_wait_s`` / ``adam_s`` / ``staging_s`` added by the
worker; ``main_wait_s`` by the training thread blocked in the step (``step()``, the write-back's
end), ``settle_wait_s`` by the training thread blocked on this step's deferred write-backs in the
next forward or a reader (``HostPlacement.settle``; the two threads add different keys) -- are
what limits offload on a given machine. Compare stages on ``main_wait_s + settle_wait_s``: which
of the two a wait lands in depends on what the stage may defer (stage 3 at several ranks waits
in the step for its persistent group, at one rank in the forward). A step's profile is published (`close`) when
the step is complete: with deferred host write-backs that is when the last of them landed,
during the next forward, so `last` is then the previous step's, whole. With the delayed update
the worker's share is the previous step's.
"""

from __future__ import annotations

from zerorun.runtime.observe.timers import PhaseValue
from zerorun.runtime.offload.host import Copier

__all__ = ["StepProfile"]


class StepProfile:
    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self._open: dict[str, float] = {}
        self._phases: dict[str, PhaseValue] = {}  # the last step's sub-phases (take)
        self.pending = False  # the step is done but its deferred write-backs are not

    def add(self, key: str, seconds: float) -> None:
        self._open[key] = self._open.get(key, 0.0) + seconds

    def close(self, copier: Copier, param_copier: Copier | None) -> None:
        """Publish the open step's profile; with the copies timed (``copier.timing``) also its
        sub-phases: the copies' CUDA marks, the worker's and the training thread's clocks, and
        stage 3's parameter fetches (``param_copier``, offload_param)."""
        self.last, self._open, self.pending = self._open, {}, False
        if not copier.timing:
            return
        prof, marks = self.last, copier.take_marks()
        self._phases = {
            "offload_d2h": marks.get("d2h", []),
            "offload_cpu_step": 1e3 * (prof.get("adam_s", 0.0) + prof.get("staging_s", 0.0)),
            "offload_h2d": marks.get("h2d", []),
            "offload_grad_wait": 1e3 * prof.get("gradient_wait_s", 0.0),
            "offload_io_wait": 1e3 * prof.get("io_wait_s", 0.0),
            "offload_step_wait": 1e3 * prof.get("main_wait_s", 0.0),
        }
        if param_copier is not None:
            self._phases["offload_param_fetch"] = param_copier.take_marks().get("h2d", [])

    def take(self) -> dict[str, PhaseValue]:
        """The last published step's sub-phases, once (the step timers call it after each step)."""
        phases, self._phases = self._phases, {}
        return phases
