"""Run a plan: start every node's ranks, multiplex what they say, fail fast, produce a result.

The supervisor knows nothing about how ranks are started: it drives `NodeRunner`s
(Contract 5 in docs/architecture.md): `launch/local.py` for this machine, `launch/ssh.py` for
remote nodes. Runners post `Message`s from their own threads into one queue; everything else
(state, fail-fast, signals, hang detection, log files, the console) happens here, on the main
thread, so none of it needs a lock.

Exit code of the launcher: 0 when every rank exited 0; the first failing rank's code
(128 + N for a rank killed by signal N); 128 + N when the launcher itself got signal N
(Ctrl-C: 130); 124 when `--hang_timeout` stopped a hung job; 255 when a node was lost.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TextIO

from zerorun.launch.plan import LaunchPlan, NodePlan, RankSpec

__all__ = [
    "RankStarted",
    "RankOutput",
    "RankEvent",
    "RankExit",
    "NodeLost",
    "Message",
    "Sink",
    "NodeRunner",
    "RankState",
    "JobResult",
    "Supervisor",
    "describe_exit",
    "exit_code_for",
    "HANG_EXIT_CODE",
    "NODE_LOST_EXIT_CODE",
]

HANG_EXIT_CODE = 124
NODE_LOST_EXIT_CODE = 255
# How long ranks get to write their stack dumps after SIGUSR1 before the job is stopped.
_STACK_DUMP_WAIT_S = 3.0
# After SIGKILL, how long to wait for runners to report the exits (remote nodes need a moment).
_AFTER_KILL_WAIT_S = 3.0
_TAIL_LINES = 20


# --- Messages a runner posts (Contract 5) -------------------------------------------------


@dataclass(frozen=True)
class RankStarted:
    rank: int
    pid: int


@dataclass(frozen=True)
class RankOutput:
    """One line of a rank's stdout or stderr, without its line ending."""

    rank: int
    stream: Literal["stdout", "stderr"]
    text: str


@dataclass(frozen=True)
class RankEvent:
    rank: int
    event: Mapping[str, Any]


@dataclass(frozen=True)
class RankExit:
    """`returncode` in Popen's convention: >= 0 exit status, -N killed by signal N."""

    rank: int
    returncode: int


@dataclass(frozen=True)
class NodeLost:
    """A node stopped answering (connection dropped, agent silent); its ranks are gone."""

    node_rank: int
    reason: str


Message = RankStarted | RankOutput | RankEvent | RankExit | NodeLost
Sink = Callable[[Message], None]


class NodeRunner(Protocol):
    """Starts and controls one node's ranks (Contract 5)."""

    node: NodePlan

    def start(self, sink: Sink) -> None:
        """Start every rank of the node (called on the launcher's main thread). Raises
        LaunchError when the node cannot start; from then on reports through `sink`, from any
        thread: RankStarted, RankOutput, RankEvent, then exactly one RankExit per rank (or a
        NodeLost)."""
        ...

    def signal(self, sig: int, *, tree: bool = True) -> None:
        """Send `sig` to every live rank: to its whole process group when `tree`, else to the
        rank process alone (SIGUSR1 asks for a stack dump; other processes would die of it)."""
        ...

    def kill(self) -> None:
        """SIGKILL every process of the node's ranks, grandchildren included. Idempotent."""
        ...

    def close(self) -> None:
        """Release threads, pipes and connections; called once, after `kill`."""
        ...


# --- State and result ---------------------------------------------------------------------


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
    reason: Literal["ok", "rank_failed", "interrupted", "hang", "node_lost"]
    ranks: list[RankState]
    wall_s: float
    first_failure: int | None = None  # rank
    message: str = ""
    hang_report: list[str] = field(default_factory=list)
    log_dir: str | None = None

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


# --- The supervisor -----------------------------------------------------------------------


class Console(Protocol):
    """What the supervisor needs from `launch.console` (rich or plain)."""

    def begin(self, plan: LaunchPlan, states: Sequence[RankState]) -> None: ...
    def output(self, lines: Sequence[RankOutput]) -> None: ...
    def note(self, text: str, *, level: Literal["info", "warn", "error"] = "info") -> None: ...
    def refresh(self) -> None: ...
    def stop(self) -> None: ...
    def end(self, result: JobResult) -> None: ...


class Supervisor:
    """One run of one plan. `run()` returns a JobResult; it never leaves a process behind."""

    def __init__(
        self,
        plan: LaunchPlan,
        runners: Sequence[NodeRunner],
        console: Console,
        *,
        grace_period: float = 5.0,
        hang_timeout: float | None = None,
        log_dir: str | Path | None = None,
    ) -> None:
        self.plan = plan
        self.runners = list(runners)
        self.console = console
        self.grace_period = grace_period
        self.hang_timeout = hang_timeout
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.states = {spec.rank: RankState(spec) for spec in plan.ranks}
        self._queue: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._pending_signal: int | None = None
        self._signals_seen = 0
        self._stopping = False
        self._stop_deadline: float | None = None
        self._killed_at: float | None = None
        self._reason: Literal["ok", "rank_failed", "interrupted", "hang", "node_lost"] = "ok"
        self._exit_code = 0
        self._first_failure: int | None = None
        self._message = ""
        self._last_activity = time.monotonic()
        self._hang_dump_until: float | None = None
        self._hang_report: list[str] = []
        self._logs: dict[int, TextIO] = {}
        self._events_log: TextIO | None = None

    # -- public -----------------------------------------------------------------------------

    def run(self) -> JobResult:
        t0 = time.monotonic()
        _become_subreaper()
        self._open_logs()
        old_handlers = self._install_signal_handlers()
        started: list[NodeRunner] = []
        try:
            self.console.begin(self.plan, list(self.states.values()))
            for runner in self.runners:
                runner.start(self._queue.put)
                started.append(runner)
            self._loop()
        except BaseException:
            self.console.stop()  # a live display must not outlive a crash
            raise
        finally:
            for runner in started:
                _quietly(runner.kill)
            self._drain_nowait()
            for runner in started:
                _quietly(runner.close)
            self._drain_nowait()
            self._restore_signal_handlers(old_handlers)
        result = JobResult(
            exit_code=self._exit_code,
            reason=self._reason,
            ranks=[self.states[r] for r in sorted(self.states)],
            wall_s=time.monotonic() - t0,
            first_failure=self._first_failure,
            message=self._message,
            hang_report=self._hang_report,
            log_dir=str(self.log_dir) if self.log_dir else None,
        )
        self._close_logs(result)
        self.console.end(result)
        return result

    # -- main loop --------------------------------------------------------------------------

    def _live(self) -> list[RankState]:
        return [s for s in self.states.values() if s.returncode is None and s.state != "lost"]

    def _loop(self) -> None:
        while self._live():
            batch = self._next_batch(timeout=0.2)
            self._handle(batch)
            now = time.monotonic()
            if self._pending_signal is not None:
                sig, self._pending_signal = self._pending_signal, None
                self._on_launcher_signal(sig)
            if self._stopping and self._killed_at is None and self._stop_deadline is not None:
                if now >= self._stop_deadline:
                    self._kill_all(f"grace period of {self.grace_period:g} s is over")
            if self._killed_at is not None and now - self._killed_at > _AFTER_KILL_WAIT_S:
                for s in self._live():
                    s.state = "lost"
                break
            self._check_hang(now)
            self.console.refresh()

    def _next_batch(self, timeout: float) -> list[Message]:
        batch: list[Message] = []
        try:
            msg = self._queue.get(timeout=timeout)
        except queue.Empty:
            return batch
        if msg is not None:
            batch.append(msg)
        # Take what is already there, up to a bound, so the console prints in chunks.
        while len(batch) < 2000:
            try:
                msg = self._queue.get_nowait()
            except queue.Empty:
                break
            if msg is not None:
                batch.append(msg)
        return batch

    def _drain_nowait(self) -> None:
        while True:
            batch = self._next_batch(timeout=0.0)
            if not batch:
                return
            self._handle(batch)

    def _handle(self, batch: Sequence[Message]) -> None:
        lines: list[RankOutput] = []
        for msg in batch:
            if isinstance(msg, RankOutput):
                self._on_output(msg)
                lines.append(msg)
                continue
            if lines:
                self.console.output(lines)
                lines = []
            if isinstance(msg, RankEvent):
                self._on_event(msg)
            elif isinstance(msg, RankStarted):
                state = self.states[msg.rank]
                state.pid, state.state, state.started = msg.pid, "running", time.monotonic()
                self._last_activity = time.monotonic()
            elif isinstance(msg, RankExit):
                self._on_exit(msg)
            elif isinstance(msg, NodeLost):
                self._on_node_lost(msg)
        if lines:
            self.console.output(lines)
        if batch and self.log_dir is not None:
            self._flush_logs()

    # -- message handlers -------------------------------------------------------------------

    def _on_output(self, msg: RankOutput) -> None:
        self._last_activity = time.monotonic()
        state = self.states[msg.rank]
        (state.stderr_tail if msg.stream == "stderr" else state.stdout_tail).append(msg.text)
        if self._hang_dump_until is not None and msg.stream == "stderr":
            state.stack_dump.append(msg.text)
        log = self._logs.get(msg.rank)
        if log is not None:
            log.write(msg.text + "\n")

    def _on_event(self, msg: RankEvent) -> None:
        state = self.states[msg.rank]
        ev = msg.event
        kind = ev.get("kind")
        if kind != "memory":
            # The shim's periodic memory snapshots come from a thread of their own: they show
            # the process is alive, not that it makes progress, so they never hide a hang.
            self._last_activity = time.monotonic()
        if kind == "memory":
            state.rss = _int(ev.get("rss"))
            state.rss_peak = _max(state.rss_peak, _int(ev.get("rss_peak")), state.rss)
            gpu = ev.get("gpu")
            if isinstance(gpu, dict):
                state.gpu = {k: int(v) for k, v in gpu.items() if isinstance(v, (int, float))}
                state.gpu_peak = _max(state.gpu_peak, state.gpu.get("peak"), state.gpu.get("allocated"))
            if isinstance(ev.get("breakdown"), dict):
                state.breakdown = dict(ev["breakdown"])
        elif kind == "status":
            state.status = {k: v for k, v in ev.items() if k not in ("kind", "t", "pid")}
        elif kind == "error":
            state.error = {k: ev.get(k) for k in ("type", "message", "traceback")}
        if self._events_log is not None:
            self._events_log.write(json.dumps({"rank": msg.rank, **ev}, default=str) + "\n")

    def _on_exit(self, msg: RankExit) -> None:
        state = self.states[msg.rank]
        if state.returncode is not None or state.state == "lost":
            return
        state.returncode = msg.returncode
        state.ended = time.monotonic()
        if state.started is None:
            state.started = state.ended
        if msg.returncode == 0:
            state.state = "exited"
        elif self._stopping:
            state.state = "stopped"  # a consequence of the stop, not a root cause
        else:
            state.state = "failed"
            self._first_failure = msg.rank
            self._reason = "rank_failed"
            self._exit_code = exit_code_for(msg.returncode)
            self._message = f"rank {_where(state.spec)} failed" + (
                " first; the other ranks were stopped" if len(self.states) > 1 else ""
            )
            others = "; stopping the other ranks" if len(self.states) > 1 else ""
            self.console.note(f"rank {_where(state.spec)} failed ({describe_exit(msg.returncode)}){others}", level="error")
            self._begin_stop(signal.SIGTERM)

    def _on_node_lost(self, msg: NodeLost) -> None:
        host = self.plan.nodes[msg.node_rank].host.name
        for state in self.states.values():
            if state.spec.node_rank == msg.node_rank and state.returncode is None:
                state.state = "lost"
                state.ended = time.monotonic()
        if not self._stopping:
            self._reason = "node_lost"
            self._exit_code = NODE_LOST_EXIT_CODE
            self._message = f"node {host} (node rank {msg.node_rank}) was lost: {msg.reason}"
            self.console.note(f"{self._message}; stopping the other nodes", level="error")
            self._begin_stop(signal.SIGTERM)

    # -- stopping ---------------------------------------------------------------------------

    def _begin_stop(self, sig: int) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._stop_deadline = time.monotonic() + self.grace_period
        for runner in self.runners:
            _quietly(runner.signal, sig, tree=True)

    def _kill_all(self, why: str) -> None:
        if self._killed_at is not None:
            return
        live = self._live()
        if live:
            names = ", ".join(_where(s.spec) for s in live)
            self.console.note(f"{why}; killing rank(s) {names}", level="warn")
        self._killed_at = time.monotonic()
        for runner in self.runners:
            _quietly(runner.kill)

    def _install_signal_handlers(self) -> dict[int, Any]:
        old: dict[int, Any] = {}

        def handler(signum: int, _frame: object) -> None:
            self._pending_signal = signum
            self._queue.put(None)  # wake the loop

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                old[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread (tests): no forwarding
                pass
        return old

    @staticmethod
    def _restore_signal_handlers(old: Mapping[int, Any]) -> None:
        for sig, h in old.items():
            signal.signal(sig, h)

    def _on_launcher_signal(self, sig: int) -> None:
        self._signals_seen += 1
        name = signal.Signals(sig).name
        if not self._stopping:
            self._reason = "interrupted"
            self._exit_code = 128 + sig
            self._message = f"the launcher got {name}; the job was stopped"
            self.console.note(
                f"{name}: forwarding to every rank; they get {self.grace_period:g} s before SIGKILL "
                "(press Ctrl-C again to kill now)",
                level="warn",
            )
            forward = signal.SIGTERM if sig == signal.SIGHUP else sig
            self._begin_stop(forward)
        elif self._signals_seen >= 2:
            self._kill_all(f"second {name}")

    # -- hangs ------------------------------------------------------------------------------

    def _check_hang(self, now: float) -> None:
        if self.hang_timeout is None or self._stopping:
            return
        if self._hang_dump_until is None:
            if now - self._last_activity < self.hang_timeout:
                return
            self.console.note(
                f"no output or event from any rank for {self.hang_timeout:g} s; asking every rank "
                "for its stacks (SIGUSR1)",
                level="warn",
            )
            self._hang_dump_until = now + _STACK_DUMP_WAIT_S
            for runner in self.runners:
                _quietly(runner.signal, signal.SIGUSR1, tree=False)
            return
        if now < self._hang_dump_until:
            return
        self._hang_report = hang_report(list(self.states.values()))
        for line in self._hang_report:
            self.console.note(line, level="warn")
        self._hang_dump_until = None
        self._reason = "hang"
        self._exit_code = HANG_EXIT_CODE
        self._message = f"no rank made progress for {self.hang_timeout:g} s (--hang_timeout)"
        self._begin_stop(signal.SIGTERM)

    # -- log files --------------------------------------------------------------------------

    def _open_logs(self) -> None:
        if self.log_dir is None:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for rank in self.states:
            # Buffered, flushed after every batch of messages (`_flush_logs`): a write per line
            # would cost more than the console itself.
            self._logs[rank] = open(self.log_dir / f"rank{rank}.log", "w", encoding="utf-8")  # noqa: SIM115
        self._events_log = open(self.log_dir / "events.jsonl", "w", encoding="utf-8")  # noqa: SIM115

    def _flush_logs(self) -> None:
        for f in self._logs.values():
            f.flush()
        if self._events_log is not None:
            self._events_log.flush()

    def _close_logs(self, result: JobResult) -> None:
        for f in self._logs.values():
            f.close()
        if self._events_log is not None:
            self._events_log.close()
        if self.log_dir is not None:
            data = {"run_id": self.plan.run_id, **result.to_json()}
            (self.log_dir / "summary.json").write_text(json.dumps(data, indent=2, default=str) + "\n")


# --- hang analysis (pure) -----------------------------------------------------------------

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")


def innermost_user_frame(dump: Sequence[str]) -> str | None:
    """From a faulthandler dump (most recent call first), the main thread's innermost frame
    outside zerorun and the standard library, as `file:line in func`."""
    blocks: list[list[tuple[str, str, str]]] = []
    for line in dump:
        if _THREAD.match(line.strip()):
            blocks.append([])
        m = _FRAME.match(line)
        if m and blocks:
            blocks[-1].append((m["file"], m["line"], m["func"]))
    if not blocks:
        return None
    # The main thread is the last block faulthandler prints (threads come newest first).
    frames = blocks[-1]
    for file, line, func in frames:
        if "/zerorun/shim.py" in file or "/threading.py" in file or "/runpy.py" in file:
            continue
        return f"{os.path.basename(file)}:{line} in {func}"
    return None


def hang_report(states: Sequence[RankState]) -> list[str]:
    """Where each rank is, and which are behind (lowest reported step, or alone at a place
    where the others are not)."""
    lines: list[str] = []
    places: dict[int, str] = {}
    for s in states:
        if s.returncode is not None:
            continue
        places[s.rank] = innermost_user_frame(s.stack_dump) or "no stack dump received"
        step = f" (last step {s.status['step']})" if s.status and "step" in s.status else ""
        lines.append(f"rank {_where(s.spec)}: {places[s.rank]}{step}")
    steps = {s.rank: s.status["step"] for s in states if s.status and isinstance(s.status.get("step"), int)}
    behind: list[int] = []
    if steps and len(set(steps.values())) > 1:
        low = min(steps.values())
        behind = sorted(r for r, st in steps.items() if st == low)
    elif len(set(places.values())) > 1:
        counts = Counter(places.values()).most_common()
        if counts[0][1] > counts[1][1]:
            # The odd ones out: usually the ranks that never reached the collective the
            # others wait in.
            behind = sorted(r for r, p in places.items() if p != counts[0][0])
        else:
            lines.append("the ranks stopped at different places (no majority to compare with)")
    if behind:
        lines.append("behind: rank(s) " + ", ".join(map(str, behind)))
    return lines


# --- helpers ------------------------------------------------------------------------------


def _where(spec: RankSpec) -> str:
    return str(spec.rank) if spec.host in ("localhost", "127.0.0.1") else f"{spec.host}:{spec.rank}"


def _int(v: object) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _max(*values: int | None) -> int | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _quietly(fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    try:
        fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - cleanup must go on for the other runners
        pass


def _become_subreaper() -> None:
    """Orphaned grandchildren of ranks (e.g. a daemon that called setsid) are re-parented to
    the launcher instead of init, so the final sweep still finds and reaps them."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass
