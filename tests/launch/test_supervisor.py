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
