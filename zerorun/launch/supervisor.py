"""Run a plan: start every node's ranks, multiplex what they say, fail fast, produce a result.

The supervisor knows nothing about how ranks are started: it drives `NodeRunner`s
(Contract 5 in docs/architecture.md; the runner interface and its messages are in
`launch/messages.py`; `launch/job.py` chooses them): `launch/local.py` for this machine,
`launch/remote.py` for nodes over SSH. Runners post `Message`s from their own threads into one
queue; everything else (state, fail-fast, signals, hang detection, log files, the console)
happens here, on the main thread, so none of it needs a lock.

Exit code of the launcher: 0 when every rank exited 0; the first failing rank's code
(128 + N for a rank killed by signal N); 128 + N when the launcher itself got signal N
(Ctrl-C: 130); 124 when `--hang_timeout` stopped a hung job; 255 when a node was lost.
"""

from __future__ import annotations

import queue
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from zerorun.launch.hang import hang_report
from zerorun.launch.joblog import JobLog
from zerorun.launch.messages import (
    Message,
    NodeLost,
    NodeRunner,
    RankEvent,
    RankExit,
    RankLines,
    RankOutput,
    RankStarted,
)
from zerorun.launch.plan import LaunchPlan
from zerorun.launch.result import (
    HANG_EXIT_CODE,
    NODE_LOST_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    JobResult,
    RankState,
    describe_exit,
    exit_code_for,
    where,
)

__all__ = ["Supervisor", "Console"]

# How long ranks get to write their stack dumps after SIGUSR1 before the job is stopped.
_STACK_DUMP_WAIT_S = 3.0
# After SIGKILL, how long to wait for runners to report the exits (remote nodes need a moment).
_AFTER_KILL_WAIT_S = 3.0
# Batching: with fewer messages than this waiting, give the runners _COALESCE_S to post more.
_COALESCE_BELOW = 64
_COALESCE_S = 0.002
# A turn of the loop takes at most this many messages, or this many rank lines.
_BATCH_MESSAGES = 2000
_BATCH_LINES = 50_000


# --- The supervisor -----------------------------------------------------------------------


class Console(Protocol):
    """What the supervisor needs from `launch.console` (rich or plain)."""

    def begin(self, plan: LaunchPlan, states: Sequence[RankState]) -> None: ...
    def output(self, runs: Sequence[RankLines | RankOutput]) -> None: ...
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
        preemption_grace: float | None = None,
    ) -> None:
        self.plan = plan
        self.runners = list(runners)
        self.console = console
        self.grace_period = grace_period
        self.hang_timeout = hang_timeout
        # --save_on_preemption: SIGTERM asks the ranks to save and exit (PREEMPTED_EXIT_CODE)
        # within this many seconds; None: SIGTERM stops them like Ctrl-C.
        self.preemption_grace = preemption_grace
        self._preempted: dict[str, Any] | None = None  # the first `preempted` event
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.states = {spec.rank: RankState(spec) for spec in plan.ranks}
        # Kept as the states change, not recounted: a scan of 8,000 states per loop turn (or
        # per lost node) is what made the loop fall behind at 1,000 nodes.
        self._live_count = len(self.states)
        self._by_node: dict[int, list[RankState]] = {}
        for st in self.states.values():
            self._by_node.setdefault(st.spec.node_rank, []).append(st)
        self._queue: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._pending_signal: int | None = None
        self._signals_seen = 0
        self._stopping = False
        self._stop_deadline: float | None = None
        self._stop_why = ""  # which grace the deadline is, for the kill message
        self._killed_at: float | None = None
        self._reason: Literal["ok", "rank_failed", "interrupted", "hang", "node_lost", "preempted"] = "ok"
        self._exit_code = 0
        self._first_failure: int | None = None
        self._message = ""
        self._last_activity = time.monotonic()
        self._hang_dump_until: float | None = None
        self._hang_report: list[str] = []
        # The files under --log_dir; None without one.
        self._joblog = JobLog(self.log_dir, plan.run_id) if self.log_dir is not None else None

    # -- public -----------------------------------------------------------------------------

    def run(self) -> JobResult:
        t0 = time.monotonic()
        _become_subreaper()
        if self._joblog is not None:
            self._joblog.open(self.states)
        old_handlers = self._install_signal_handlers()
        started: list[NodeRunner] = []
        failure: BaseException | None = None
        try:
            self.console.begin(self.plan, list(self.states.values()))
            for runner in self.runners:
                runner.start(self._queue.put)
                started.append(runner)
            self._loop()
        except BaseException as exc:
            failure = exc
            self.console.stop()  # a live display must not outlive a crash
            raise
        finally:
            for runner in started:
                _quietly(runner.kill)
            self._drain_nowait()
            # Every runner, started or not: when one's start() failed, the ones after it still
            # hold a node's link, agent, srun/mpirun or simulated host, which close() releases.
            for runner in self.runners:
                _quietly(runner.close)
            self._drain_nowait()
            self._restore_signal_handlers(old_handlers)
            if failure is not None and self._joblog is not None:
                # No result comes: write what arrived (output of the nodes that did start) and
                # close the files and the writer thread here, or they leak and the lines are lost.
                error = f"{type(failure).__name__}: {failure}"
                _quietly(self._joblog.abort, error, [self.states[r] for r in sorted(self.states)])
        self._settle_preemption()
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
        if self._joblog is not None:
            self._joblog.close(result)
        self.console.end(result)
        return result

    # -- main loop --------------------------------------------------------------------------

    def _live(self) -> list[RankState]:
        return [s for s in self.states.values() if s.returncode is None and s.state != "lost"]

    def _loop(self) -> None:
        while self._live_count > 0:
            batch = self._next_batch(timeout=0.2)
            self._handle(batch)
            now = time.monotonic()
            if self._pending_signal is not None:
                sig, self._pending_signal = self._pending_signal, None
                self._on_launcher_signal(sig)
            if self._stopping and self._killed_at is None and self._stop_deadline is not None:
                if now >= self._stop_deadline:
                    self._kill_all(self._stop_why)
            if self._killed_at is not None and now - self._killed_at > _AFTER_KILL_WAIT_S:
                for s in self._live():
                    s.state = "lost"
                self._live_count = 0
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
        if self._queue.qsize() < _COALESCE_BELOW:
            # A trickle from many nodes would otherwise be handled a few messages per turn, each
            # turn paying the loop's fixed costs: wait a moment for more (adds <= 2 ms of lag).
            time.sleep(_COALESCE_S)
        # Take what is already there, up to a bound (messages, and lines: a `RankLines` is a
        # whole read of a pipe), so the console prints in chunks and the loop's checks still run.
        lines = 0
        while len(batch) < _BATCH_MESSAGES and lines < _BATCH_LINES:
            try:
                msg = self._queue.get_nowait()
            except queue.Empty:
                break
            if msg is not None:
                batch.append(msg)
                if type(msg) is RankLines:
                    lines += len(msg.lines)
        return batch

    def _drain_nowait(self) -> None:
        while True:
            batch = self._next_batch(timeout=0.0)
            if not batch:
                return
            self._handle(batch)

    def _handle(self, batch: Sequence[Message]) -> None:
        lines: list[RankLines | RankOutput] = []
        runs: list[RankLines | RankOutput] = []  # the batch's, for the log files: one hand-over
        count = 0
        for msg in batch:
            if isinstance(msg, (RankLines, RankOutput)):
                count += self._on_output(msg)
                lines.append(msg)
                runs.append(msg)
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
        if batch and self._joblog is not None:
            self._joblog.runs(runs, count)
            self._joblog.flush()

    # -- message handlers -------------------------------------------------------------------

    def _on_output(self, msg: RankLines | RankOutput) -> int:
        """A run of a rank's lines (a `RankOutput` is a run of one): per run, not per line (the
        log files get the batch's runs in `_handle`). The number of lines."""
        self._last_activity = time.monotonic()
        state = self.states[msg.rank]
        lines = msg.lines
        (state.stderr_tail if msg.stream == "stderr" else state.stdout_tail).extend(lines)
        if self._hang_dump_until is not None and msg.stream == "stderr":
            state.stack_dump.extend(lines)
        return len(lines)

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
        elif kind == "preempted" and self._preempted is None:
            self._preempted = {k: ev.get(k) for k in ("tag", "dir", "step")}
            self.console.note(f"preempted: the ranks saved checkpoint {ev.get('tag')} in {ev.get('dir')} and are exiting")
        if self._joblog is not None:
            self._joblog.event(msg.rank, ev)

    def _on_exit(self, msg: RankExit) -> None:
        state = self.states[msg.rank]
        if state.returncode is not None or state.state == "lost":
            return
        state.returncode = msg.returncode
        self._live_count -= 1
        state.ended = time.monotonic()
        if state.started is None:
            state.started = state.ended
        if msg.returncode == 0:
            state.state = "exited"
        elif msg.returncode == PREEMPTED_EXIT_CODE and self.preemption_grace is not None:
            state.state = "exited"  # saved its part of the checkpoint and stopped, as asked
        elif self._stopping:
            state.state = "stopped"  # a consequence of the stop, not a root cause
        else:
            state.state = "failed"
            self._first_failure = msg.rank
            self._reason = "rank_failed"
            self._exit_code = exit_code_for(msg.returncode)
            self._message = f"rank {where(state.spec)} failed" + (
                " first; the other ranks were stopped" if len(self.states) > 1 else ""
            )
            others = "; stopping the other ranks" if len(self.states) > 1 else ""
            self.console.note(f"rank {where(state.spec)} failed ({describe_exit(msg.returncode)}){others}", level="error")
            self._begin_stop(signal.SIGTERM)

    def _on_node_lost(self, msg: NodeLost) -> None:
        host = self.plan.nodes[msg.node_rank].host.name
        for state in self._by_node.get(msg.node_rank, ()):
            if state.returncode is None and state.state != "lost":
                state.state = "lost"
                state.ended = time.monotonic()
                self._live_count -= 1
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
        self._stop_why = f"grace period of {self.grace_period:g} s is over"
        for runner in self.runners:
            _quietly(runner.signal, sig, tree=True)

    def _kill_all(self, why: str) -> None:
        if self._killed_at is not None:
            return
        live = self._live()
        if live:
            names = ", ".join(where(s.spec) for s in live)
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
        if not self._stopping and sig == signal.SIGTERM and self.preemption_grace is not None:
            self._reason = "interrupted"  # until the ranks report their save (_settle_preemption)
            self._exit_code = 128 + sig
            self._message = f"the launcher got {name}; the ranks did not all save a checkpoint"
            self.console.note(
                f"{name}: the ranks save a checkpoint at their next step boundary and exit (--save_on_preemption); "
                f"they get {self.preemption_grace:g} s before SIGKILL",
                level="warn",
            )
            self._stopping = True
            self._stop_deadline = time.monotonic() + self.preemption_grace
            self._stop_why = f"preemption grace of {self.preemption_grace:g} s is over (--preemption_grace)"
            for runner in self.runners:
                # The rank alone: its DataLoader workers and other children must live until it saved.
                _quietly(runner.signal, sig, tree=False)
            return
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

    def _settle_preemption(self) -> None:
        """Every rank exited 0 or PREEMPTED_EXIT_CODE after a `preempted` event: the job was
        preempted with its checkpoint saved (whoever sent the SIGTERM), not failed."""
        if self._preempted is None or self.preemption_grace is None:
            return
        codes = [s.returncode for s in self.states.values()]
        if PREEMPTED_EXIT_CODE in codes and all(c in (0, PREEMPTED_EXIT_CODE) for c in codes):
            self._reason = "preempted"
            self._exit_code = PREEMPTED_EXIT_CODE
            self._message = f"preempted; checkpoint {self._preempted.get('tag')} saved in {self._preempted.get('dir')}"
            self.console.note(self._message)

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


# --- helpers ------------------------------------------------------------------------------


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
