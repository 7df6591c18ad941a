"""The job's result model: per-rank state, the final `JobResult`, and how exits are told.

The supervisor fills these in; the console renders them and `summary.json` is their
`to_json()`. Pure data and pure functions: no processes, no I/O.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from zerorun.launch.plan import RankSpec

__all__ = [
    "RankState",
    "JobResult",
    "describe_exit",
    "exit_code_for",
    "where",
    "HANG_EXIT_CODE",
    "NODE_LOST_EXIT_CODE",
    "PREEMPTED_EXIT_CODE",
]

HANG_EXIT_CODE = 124
# Ranks that saved a checkpoint after SIGTERM with --save_on_preemption exit with this code, and
# so does the launcher (EX_TEMPFAIL; the runtime's runtime/checkpoint/options.py has the same).
PREEMPTED_EXIT_CODE = 75
NODE_LOST_EXIT_CODE = 255
_TAIL_LINES = 20


@dataclass
class RankState:
    spec: RankSpec
    pid: int | None = None
    state: Literal["starting", "running", "exited", "failed", "stopped", "lost"] = "starting"
    returncode: int | None = None
    started: float | None = None
    ended: float | None = None
    rss: int | None = None
    rss_peak: int | None = None
    gpu: dict[str, int] | None = None
    gpu_peak: int | None = None
    breakdown: dict[str, Any] | None = None
    status: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=_TAIL_LINES))
    stdout_tail: deque[str] = field(default_factory=lambda: deque(maxlen=_TAIL_LINES))
    stack_dump: list[str] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def label(self) -> str:
        return str(self.spec.rank)

    @property
    def wall_s(self) -> float | None:
        if self.started is None:
            return None
        return (self.ended or time.monotonic()) - self.started

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.spec.rank,
            "local_rank": self.spec.local_rank,
            "node_rank": self.spec.node_rank,
            "host": self.spec.host,
            "pid": self.pid,
            "state": self.state,
            "returncode": self.returncode,
            "exit": describe_exit(self.returncode) if self.returncode is not None else None,
            "wall_s": round(self.wall_s, 3) if self.wall_s is not None else None,
            "rss_peak": self.rss_peak,
            "gpu_peak": self.gpu_peak,
            "breakdown": self.breakdown,
            "status": self.status,
            "error": self.error,
        }


@dataclass
class JobResult:
    exit_code: int
    reason: Literal["ok", "rank_failed", "interrupted", "hang", "node_lost", "preempted"]
    ranks: list[RankState]
    wall_s: float
    first_failure: int | None = None  # rank
    message: str = ""
    hang_report: list[str] = field(default_factory=list)
    log_dir: str | None = None
    batch_note: str | None = None  # run_job: what a restart at another world size changed in the batch triad

    def to_json(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "reason": self.reason,
            "first_failure": self.first_failure,
            "message": self.message,
            "hang_report": self.hang_report,
            "wall_s": round(self.wall_s, 3),
            "ranks": [r.to_json() for r in self.ranks],
        }


_SIGNAL_HINTS = {
    signal.SIGKILL: "likely the OOM killer (check `dmesg`) or a scheduler enforcing a limit",
    signal.SIGBUS: "bus error, often /dev/shm too small (docker: --shm-size=16g or --ipc=host)",
    signal.SIGABRT: "aborted: a C++ exception or failed assertion (e.g. a CUDA/NCCL error)",
    signal.SIGSEGV: "segmentation fault in native code",
    signal.SIGTERM: "terminated",
    signal.SIGINT: "interrupted",
    signal.SIGHUP: "hang-up: the terminal or session went away",
    signal.SIGFPE: "arithmetic error in native code",
    signal.SIGILL: "illegal instruction (binary built for another CPU?)",
    signal.SIGPIPE: "broken pipe",
}


def describe_exit(returncode: int) -> str:
    """0 -> "exit 0"; 3 -> "exit 3"; -9 -> "signal 9 (SIGKILL): likely the OOM killer ..."."""
    if returncode >= 0:
        return f"exit {returncode}"
    num = -returncode
    try:
        sig = signal.Signals(num)
    except ValueError:
        return f"signal {num}"
    hint = _SIGNAL_HINTS.get(sig)
    return f"signal {num} ({sig.name})" + (f": {hint}" if hint else "")


def exit_code_for(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


def where(spec: RankSpec) -> str:
    """A rank as messages name it: "3" on this machine, "host:3" on another node."""
    return str(spec.rank) if spec.host in ("localhost", "127.0.0.1") else f"{spec.host}:{spec.rank}"
