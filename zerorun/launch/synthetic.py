"""Synthetic ranks for the scale simulation: what a node's ranks would say, without processes.

A `SyntheticRunner` stands where `launch.local.LocalRunner` stands inside a node agent
(`launch/agent.py` builds it through its `runner_factory`), so the agent, the wire protocol
and everything on the launcher's side run as in a real job. Its ranks print lines, send memory
and status events at the `Scenario`'s rates, and fail, hang or go silent on cue; they answer
signals like shim-started ranks do (SIGTERM/SIGINT: exit -N unless hung; SIGUSR1: a stack dump
on stderr; kill: -9). Stdlib only: this runs inside the simulated agents' hosts.

Timing: every `Scenario` time is seconds after the node's plan arrived (its ranks started).
Every stdout line carries `t=<time.monotonic()>` of the moment it was "printed", which is the
same clock in every process of the machine, so the launcher can measure a line's lag.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Scenario", "SyntheticRunner", "WARNING_TEXT"]

WARNING_TEXT = "UserWarning: synthetic warning, the same on every rank"
_PID_BASE = 100_000


@dataclass(frozen=True)
class Scenario:
    """What the simulated cluster does. Node and rank numbers are the plan's."""

    line_rate: float = 1.0  # stdout lines per second per rank
    event_interval_s: float = 1.0  # a memory and a status event per rank this often (0: never)
    duration_s: float | None = None  # every rank exits 0 after this (None: until stopped)
    warn_interval_s: float | None = None  # the same warning on stderr of every rank this often
    fail: Mapping[int, tuple[float, int]] = field(default_factory=dict)  # rank -> (at_s, exit code)
    hang: Mapping[int, float] = field(default_factory=dict)  # rank -> at_s: stops printing, ignores SIGTERM
    silent: Mapping[int, float] = field(default_factory=dict)  # node -> at_s: agent stops talking and listening
    drop: Mapping[int, float] = field(default_factory=dict)  # node -> at_s: its link is cut (EOF)
    connect_latency_s: float = 0.0  # per connection attempt, before the agent is reachable
    connect_failures: Mapping[int, int] = field(default_factory=dict)  # node -> attempts refused first
    version_mismatch: Sequence[int] = ()  # nodes whose agent reports another zerorun version
    agents_per_process: int = 0  # 0: spread the nodes over a few host processes
    host_nice: int = 0  # niceness of the agent hosts: >0 gives the launcher (what is measured) the CPU first

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in ("fail", "hang", "silent", "drop", "connect_failures"):
            data[name] = {str(k): v for k, v in data[name].items()}
        data["version_mismatch"] = list(self.version_mismatch)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Scenario:
        d = dict(data)
        d["fail"] = {int(k): (float(v[0]), int(v[1])) for k, v in d.get("fail", {}).items()}
        for name in ("hang", "silent", "drop"):
            d[name] = {int(k): float(v) for k, v in d.get(name, {}).items()}
        d["connect_failures"] = {int(k): int(v) for k, v in d.get("connect_failures", {}).items()}
        d["version_mismatch"] = tuple(int(n) for n in d.get("version_mismatch", ()))
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class _Rank:
    rank: int
    pid: int
    next_line: float
    next_event: float
    next_warn: float
    step: int = 0
    done: bool = False


class SyntheticRunner:
    """The `NodeRunner` interface over synthetic ranks; driven by `tick(now)` from the host's
    clock thread (no thread per rank or per node)."""

    def __init__(self, plan: Any, node: Any, scenario: Scenario, *, on_done: Callable[[], None] | None = None) -> None:
        self.plan = plan
        self.node = node
        self.scenario = scenario
        self.on_done = on_done
        self._lock = threading.Lock()
        self._ranks: dict[int, _Rank] = {}
        self._sink: Any = None
        self._t0 = 0.0
        self.next_due = 0.0

    def start(self, sink: Any) -> None:
        from zerorun.launch.messages import RankStarted

        self._sink = sink
        now = time.monotonic()
        self._t0 = now
        line_gap = 1.0 / self.scenario.line_rate if self.scenario.line_rate > 0 else float("inf")
        for i, spec in enumerate(self.node.ranks):
            # Spread the ranks' first lines over one period: no thundering herd every second.
            offset = line_gap * (i / max(1, len(self.node.ranks))) if line_gap != float("inf") else 0.0
            r = _Rank(spec.rank, _PID_BASE + spec.rank, now + offset, now + offset, now + offset)
            self._ranks[spec.rank] = r
            sink(RankStarted(spec.rank, r.pid))

    # -- the clock ---------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        from zerorun.launch.messages import RankEvent, RankOutput

        sc = self.scenario
        elapsed = now - self._t0
        sink = self._sink
        with self._lock:
            live = [r for r in self._ranks.values() if not r.done]
        for r in live:
            fail = sc.fail.get(r.rank)
            if fail is not None and elapsed >= fail[0]:
                sink(RankOutput(r.rank, "stderr", f"RuntimeError: synthetic failure of rank {r.rank}"))
                self._exit(r, fail[1])
                continue
            if sc.duration_s is not None and elapsed >= sc.duration_s:
                self._exit(r, 0)
                continue
            hung_at = sc.hang.get(r.rank)
            if hung_at is not None and elapsed >= hung_at:
                continue
            if sc.line_rate > 0:
                gap = 1.0 / sc.line_rate
                if now - r.next_line > 1.0:
                    r.next_line = now  # the host fell behind: those lines are never written
                while r.next_line <= now:
                    r.step += 1
                    sink(RankOutput(r.rank, "stdout", f"step {r.step} loss {3.0 / (1 + r.step * 1e-3):.4f} t={time.monotonic():.6f}"))
                    r.next_line += gap
            if sc.event_interval_s and r.next_event <= now:
                rss = (200 + r.rank % 7) << 20
                sink(RankEvent(r.rank, {"kind": "memory", "rss": rss, "rss_peak": rss,
                                        "gpu": {"allocated": (10 + r.rank % 5) << 30, "reserved": 16 << 30, "peak": 15 << 30}}))
                sink(RankEvent(r.rank, {"kind": "status", "step": r.step, "loss": 3.0}))
                r.next_event = now + sc.event_interval_s
            if sc.warn_interval_s and r.next_warn <= now:
                sink(RankOutput(r.rank, "stderr", WARNING_TEXT))
                r.next_warn = now + sc.warn_interval_s
        flush = getattr(sink, "flush", None)  # the agent's LineBatcher: this tick's lines, now
        if flush is not None:
            flush()
        self.next_due = self._due(live, now)

    def _due(self, ranks: list[_Rank], now: float) -> float:
        """When `tick` next has something to do (the host skips the runner until then)."""
        sc = self.scenario
        due = float("inf") if sc.duration_s is None else self._t0 + sc.duration_s
        for r in ranks:
            if r.done:
                continue
            fail = sc.fail.get(r.rank)
            if fail is not None:
                due = min(due, self._t0 + fail[0])
            hung_at = sc.hang.get(r.rank)
            if hung_at is not None and now - self._t0 >= hung_at:
                continue
            if hung_at is not None:
                due = min(due, self._t0 + hung_at)
            if sc.line_rate > 0:
                due = min(due, r.next_line)
            if sc.event_interval_s:
                due = min(due, r.next_event)
            if sc.warn_interval_s:
                due = min(due, r.next_warn)
        return due

    def _exit(self, r: _Rank, code: int) -> None:
        from zerorun.launch.messages import RankExit

        with self._lock:
            if r.done:
                return
            r.done = True
            finished = all(x.done for x in self._ranks.values())
        self._sink(RankExit(r.rank, code))
        if finished and self.on_done is not None:
            self.on_done()

    # -- NodeRunner --------------------------------------------------------------------------

    def alive(self) -> int:
        with self._lock:
            return sum(1 for r in self._ranks.values() if not r.done)

    def signal(self, sig: int, *, tree: bool = True) -> None:
        from zerorun.launch.messages import RankOutput

        with self._lock:
            live = [r for r in self._ranks.values() if not r.done]
        for r in live:
            if sig == signal.SIGUSR1:
                for line in ("Current thread 0x00007f (most recent call first):",
                             '  File "train.py", line 42 in train_step'):
                    self._sink(RankOutput(r.rank, "stderr", line))
            elif sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) and r.rank not in self.scenario.hang:
                self._exit(r, -sig)

    def kill(self) -> None:
        with self._lock:
            live = [r for r in self._ranks.values() if not r.done]
        for r in live:
            self._exit(r, -signal.SIGKILL)

    def close(self) -> None:
        pass
