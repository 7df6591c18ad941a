"""Runs of lines (`RankLines`) end to end without processes: the supervisor's tails, log files
and consoles, the large-job view, the wire and the per-node relay give for a run exactly what
they gave for the same lines one `RankOutput` each (the real reader and agent are in
test_output_path.py and test_agent_lines.py)."""

from __future__ import annotations

import io
from pathlib import Path

from _plans import plan_for
from test_console_scale import _large_job
from test_output_path import _rich
from test_supervisor import ScriptedRunner

from zerorun.launch import wire
from zerorun.launch.console import PlainConsole
from zerorun.launch.hosts import Host
from zerorun.launch.messages import RankExit, RankLines, RankOutput, RankStarted
from zerorun.launch.result import RankState
from zerorun.launch.supervisor import Supervisor


def _per_line(runs: list[object]) -> list[RankOutput]:
    return [RankOutput(m.rank, m.stream, t) for m in runs for t in m.lines]  # type: ignore[attr-defined]


RUNS: list[object] = [
    RankLines(0, "stdout", ["a 1", "a 2", "a 3"]),
    RankOutput(1, "stdout", "b 1"),
    RankLines(0, "stderr", ["warn \x07 [bold]x[/bold]", "warn 2"]),
    RankLines(1, "stdout", []),  # an empty run prints nothing
    RankLines(1, "stderr", ["Traceback", "  boom"]),
    RankLines(0, "stdout", ["a 4"]),
]


def test_supervisor_takes_runs_for_tails_logs_and_console(tmp_path: Path) -> None:
    plan = plan_for(num_gpus=2)
    script = [RankStarted(0, 10), RankStarted(1, 11), *RUNS, RankExit(1, 3), RankExit(0, 0)]
    out, err = io.StringIO(), io.StringIO()
    result = Supervisor(plan, [ScriptedRunner(plan.nodes[0], script)], PlainConsole(out=out, err=err), log_dir=tmp_path).run()
    assert result.exit_code == 3 and result.first_failure == 1
    # Every line, in each rank's order, both streams in the rank's log file.
    assert (tmp_path / "rank0.log").read_text() == "a 1\na 2\na 3\nwarn \x07 [bold]x[/bold]\nwarn 2\na 4\n"
    assert (tmp_path / "rank1.log").read_text() == "b 1\nTraceback\n  boom\n"
    assert out.getvalue() == "[0] a 1\n[0] a 2\n[0] a 3\n[1] b 1\n[0] a 4\n"
    assert "[0] warn \x07 [bold]x[/bold]\n[0] warn 2\n[1] Traceback\n[1]   boom\n" in err.getvalue()
    r0, r1 = result.ranks
    assert list(r0.stdout_tail) == ["a 1", "a 2", "a 3", "a 4"] and list(r1.stderr_tail) == ["Traceback", "  boom"]
    assert "  boom" in err.getvalue().split("zerorun: FAILED")[1]  # the failure summary's tail


def test_consoles_print_a_run_as_they_print_its_lines_one_by_one() -> None:
    plan = plan_for(num_gpus=2)
    states = [RankState(spec) for spec in plan.ranks]
    for ranks in (None, frozenset({1})):
        got, want = [], []
        for runs, texts in ((RUNS, got), (_per_line(RUNS), want)):
            out, err = io.StringIO(), io.StringIO()
            console = PlainConsole(out=out, err=err, ranks=ranks)
            console.begin(plan, states)
            console.output(runs)  # type: ignore[arg-type]
            texts.append((out.getvalue(), err.getvalue()))
            rich, rout = _rich(plan, states, ranks=ranks)
            rich.output(runs)  # type: ignore[arg-type]
            rich.stop()
            texts.append(rout.getvalue())
        assert got == want
        if ranks is None:  # the rich console strips the rank's control codes, keeps its text
            assert "warn  [bold]x[/bold]" in want[1] and "warn \x07" in want[0][1]


def test_large_job_view_takes_each_line_of_a_run() -> None:
    plan, states = _large_job(nodes=20, per=8)
    texts = []
    for per_line in (False, True):
        out, err = io.StringIO(), io.StringIO()
        console = PlainConsole(out=out, err=err)
        console.begin(plan, states)
        runs = [
            RankLines(0, "stdout", ["step 1", "step 2"]),
            RankLines(9, "stderr", ["fine", "UserWarning: slow", "last of 9"]),
            RankLines(10, "stderr", ["UserWarning: slow"]),
        ]
        console.output(_per_line(runs) if per_line else runs)  # type: ignore[arg-type]
        assert console._large is not None and console._large.last_lines[1] == "UserWarning: slow"
        console.end(_result(states))
        texts.append((out.getvalue(), err.getvalue().split("zerorun: summary")[0]))
    assert texts[0] == texts[1]
    assert texts[0][0].splitlines() == ["[sim-0000:0]   step 1", "[sim-0000:0]   step 2"]
    assert "[9-10] UserWarning: slow" in texts[0][1]


def _result(states):  # type: ignore[no-untyped-def]
    from zerorun.launch.result import JobResult

    return JobResult(exit_code=0, reason="ok", ranks=states, wall_s=1.0)


def test_runs_on_the_wire() -> None:
    kind, fields = wire.message_to_wire(RankLines(3, "stderr", ["x", 'y {"j"}']))  # type: ignore[misc]
    msg = wire.decode(wire.encode(kind, **fields))
    assert msg is not None and wire.messages_from_wire(msg) == [RankLines(3, "stderr", ["x", 'y {"j"}'])]
    # One RankLines per run; an empty run dropped; a non-string line (a faulty sender) as text.
    got = wire.messages_from_wire({"t": "lines", "runs": [[0, "stdout", ["a", "b"]], [1, "stdout", []], [1, "stderr", [5]]]})
    assert got == [RankLines(0, "stdout", ["a", "b"]), RankLines(1, "stderr", ["5"])]


def test_the_per_node_relay_forwards_runs_to_node_0() -> None:
    """Per-node mode: a node's runs go to node 0 as `lines` messages, and node 0 posts each run
    to that node's PeerRunner (message_from_wire alone dropped `lines`)."""
    from zerorun.launch import rendezvous

    plan = plan_for([Host("a", (0,)), Host("b", (0,))])
    sent: list[tuple[str, dict]] = []

    class Link:
        def send(self, kind: str, **fields: object) -> bool:
            sent.append((kind, fields))
            return True

    class Session:
        is_hub = False
        links = {0: Link()}

    relay = rendezvous._Relay(Session(), plan, {})  # type: ignore[arg-type]
    relay.local(RankLines(1, "stdout", ["one", "two"]))
    assert sent == [("lines", {"runs": [[1, "stdout", ["one", "two"]]]})]

    peer = rendezvous.PeerRunner(plan.nodes[1])
    posted: list[object] = []
    peer.start(posted.append)
    Session.is_hub = True
    hub = rendezvous._Relay(Session(), plan, {1: peer})  # type: ignore[arg-type]
    hub._on_message(1, {"t": sent[0][0], **sent[0][1]})
    assert posted == [RankLines(1, "stdout", ["one", "two"])]


def test_a_run_is_notable_exactly_when_one_of_its_lines_is() -> None:
    """The large-job view searches a run joined before its lines (no keyword spans a line break)."""
    from zerorun.launch import rollup

    runs = [
        ["err", "or: x"], ["Warn", "ing:"], ["x Warning", ":"], ["errors=0", "nan_count 3"], ["ok", "oom"],
        ["a", "b", "RuntimeError: y"], ["warnings_total 2", "Error", ""], ["", ""], ["step 1", "step 2"],
    ]
    for lines in runs:
        assert rollup.is_notable("\n".join(lines)) == any(rollup.is_notable(t) for t in lines), lines
