"""launch/supervisor.py driven by scripted node runners (the NodeRunner protocol, without processes)."""

from __future__ import annotations

import io
import json
import signal
from pathlib import Path

from _plans import plan_for

from zerorun.launch.console import PlainConsole
from zerorun.launch.hosts import Host
from zerorun.launch.messages import NodeLost, RankEvent, RankExit, RankOutput, RankStarted
from zerorun.launch.supervisor import Supervisor


class ScriptedRunner:
    """A NodeRunner that replays messages (the protocol, without processes)."""

    def __init__(self, node, script) -> None:
        self.node = node
        self.script = script
        self.signals: list[tuple[int, bool]] = []
        self.killed = 0

    def start(self, sink) -> None:
        self.sink = sink
        for msg in self.script:
            sink(msg)

    def signal(self, sig: int, *, tree: bool = True) -> None:
        self.signals.append((sig, tree))
        for r in self.node.ranks:
            self.sink(RankExit(r.rank, -sig))

    def kill(self) -> None:
        self.killed += 1

    def close(self) -> None:
        pass


def test_supervisor_fail_fast_across_nodes_and_node_lost(tmp_path: Path) -> None:
    hosts = [Host("a", (0,)), Host("b", (0,))]
    plan = plan_for(hosts)
    node_a = ScriptedRunner(plan.nodes[0], [RankStarted(0, 100), RankOutput(0, "stdout", "hi")])
    node_b = ScriptedRunner(plan.nodes[1], [RankStarted(1, 200), RankEvent(1, {"kind": "status", "step": 4}), RankExit(1, 3)])
    err = io.StringIO()
    result = Supervisor(plan, [node_a, node_b], PlainConsole(out=io.StringIO(), err=err), log_dir=tmp_path).run()
    assert result.exit_code == 3 and result.first_failure == 1
    assert node_a.signals == [(signal.SIGTERM, True)] and node_a.killed and node_b.killed
    assert [s.state for s in result.ranks] == ["stopped", "failed"]
    assert json.loads((tmp_path / "summary.json").read_text())["ranks"][1]["status"] == {"step": 4}
    assert (tmp_path / "rank0.log").read_text() == "hi\n"

    node_a = ScriptedRunner(plan.nodes[0], [RankStarted(0, 100)])
    node_b = ScriptedRunner(plan.nodes[1], [RankStarted(1, 200), NodeLost(1, "connection reset")])
    result = Supervisor(plan, [node_a, node_b], PlainConsole(out=io.StringIO(), err=io.StringIO())).run()
    assert result.exit_code == 255 and result.reason == "node_lost" and "node b" in result.message
    assert [s.state for s in result.ranks] == ["stopped", "lost"]


def test_a_runner_that_fails_to_start_leaves_nothing_open() -> None:
    """start() of node b raises (its link closed after the preflight): the supervisor kills
    node a's ranks and closes every runner, also c's, which never started and still held its
    node's agent (before: only started runners were closed; c's srun/link/simulated host and a
    LocalRunner's pipes stayed open)."""
    import pytest

    from zerorun.errors import LaunchError

    class Failing(ScriptedRunner):
        def start(self, sink) -> None:
            raise LaunchError("the link to b closed before the job started")

    closed: list[str] = []

    def closing(cls, name, node, script):
        runner = cls(node, script)
        runner.close = lambda: closed.append(name)  # type: ignore[method-assign]
        return runner

    plan = plan_for([Host("a", (0,)), Host("b", (0,)), Host("c", (0,))])
    a = closing(ScriptedRunner, "a", plan.nodes[0], [RankStarted(0, 100)])
    b = closing(Failing, "b", plan.nodes[1], [])
    c = closing(ScriptedRunner, "c", plan.nodes[2], [])
    with pytest.raises(LaunchError, match="closed before the job started"):
        Supervisor(plan, [a, b, c], PlainConsole(out=io.StringIO(), err=io.StringIO())).run()
    assert a.killed and not c.killed
    assert closed == ["a", "b", "c"]


def test_sigterm_with_save_on_preemption_names_its_own_grace_when_it_kills() -> None:
    """SIGTERM with --save_on_preemption: the ranks alone get SIGTERM (not their trees); ranks
    that do not exit within the preemption grace are killed, and the kill names that grace
    (before: "grace period of 5 s", the other knob)."""

    class Deaf(ScriptedRunner):
        def signal(self, sig: int, *, tree: bool = True) -> None:
            self.signals.append((sig, tree))  # the rank keeps running (saving forever)

        def kill(self) -> None:
            super().kill()
            for r in self.node.ranks:
                self.sink(RankExit(r.rank, -9))

    plan = plan_for([Host("a", (0,))])
    runner = Deaf(plan.nodes[0], [RankStarted(0, 100)])
    err = io.StringIO()
    sup = Supervisor(plan, [runner], PlainConsole(out=io.StringIO(), err=err), grace_period=5.0, preemption_grace=0.3)
    sup._pending_signal = signal.SIGTERM  # as the handler sets it
    result = sup.run()
    assert runner.signals == [(signal.SIGTERM, False)] and runner.killed
    assert result.exit_code == 128 + signal.SIGTERM and result.reason == "interrupted"
    assert "preemption grace of 0.3 s is over" in err.getvalue() and "grace period of 5" not in err.getvalue()


def test_a_start_that_raises_still_writes_and_closes_the_job_log(tmp_path: Path) -> None:
    """A real rank on node a prints; node b's start() raises. The job log keeps the lines that
    arrived, summary.json says the run did not start and why, and the log's files and writer
    thread are closed (before: the exception skipped JobLog.close -- lines lost, files and the
    writer thread leaked)."""
    import os
    import sys
    import threading
    import time

    import pytest
    from _launch import base_env

    from zerorun.errors import LaunchError
    from zerorun.launch.local import LocalRunner
    from zerorun.launch.plan import DeviceInfo, LaunchOptions, Target, build_plan

    script = tmp_path / "talk.py"
    marker = tmp_path / "printed"
    script.write_text(
        "import pathlib, sys, time\nfor i in range(3):\n    print('line', i, flush=True)\n"
        f"pathlib.Path({str(marker)!r}).write_text('x')\ntime.sleep(60)\n"
    )
    options = LaunchOptions(target=Target(script=str(script)), device="cpu")
    plan = build_plan(
        options, [Host("localhost", (0,)), Host("b", (0,))], DeviceInfo(gpus=(), cores=2), master_port=29500,
        run_id="joblog-abort", cwd=str(tmp_path),
    )
    logs = tmp_path / "logs"
    env, _tag = base_env()
    sup: Supervisor

    class FailsOnceTheLinesArrived(ScriptedRunner):
        def start(self, sink) -> None:
            deadline = time.monotonic() + 60
            while not (marker.exists() and sup._queue.qsize() >= 4) and time.monotonic() < deadline:
                time.sleep(0.02)  # the rank printed; its lines (and RankStarted) are queued
            time.sleep(0.3)  # the reader thread posts lines as they come: any stragglers too
            raise LaunchError("the link to b closed before the job started")

    local = LocalRunner(plan, plan.nodes[0], python=sys.executable, environ=env)
    sup = Supervisor(
        plan, [local, FailsOnceTheLinesArrived(plan.nodes[1], [])], PlainConsole(out=io.StringIO(), err=io.StringIO()),
        log_dir=logs,
    )
    with pytest.raises(LaunchError, match="closed before the job started"):
        sup.run()
    assert (logs / "rank0.log").read_text() == "line 0\nline 1\nline 2\n"
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["reason"] == "not_started" and summary["exit_code"] is None
    assert summary["message"] == "LaunchError: the link to b closed before the job started"
    assert [r["state"] for r in summary["ranks"]][1] == "starting"
    assert not any(t.name == "zerorun-joblog" and t.is_alive() for t in threading.enumerate())
    open_files = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            open_files.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:  # the directory listing's own descriptor
            pass
    assert not [f for f in open_files if f.startswith(str(logs))], open_files
