"""launch/agent.py's LineBatcher and the `lines` message: a node's rank lines travel in batches,
in order, whole, and none is held back past the next other message or the end of a turn."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerorun.launch import wire
from zerorun.launch.agent import LineBatcher
from zerorun.launch.messages import RankEvent, RankExit, RankLines, RankOutput, RankStarted


def _flat(msgs: list[object]) -> list[object]:
    """Messages with every run of lines as one RankOutput per line (what is compared)."""
    out: list[object] = []
    for m in msgs:
        if isinstance(m, (RankLines, RankOutput)):
            out.extend(RankOutput(m.rank, m.stream, t) for t in m.lines)
        else:
            out.append(m)
    return out


class _Channel:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, encoded: bytes) -> None:
        self.writes.append(encoded)

    def messages(self) -> list[object]:
        out: list[object] = []
        for line in b"".join(self.writes).splitlines():
            msg = wire.decode(line)
            assert msg is not None
            out.extend(wire.messages_from_wire(msg))
        return out


def test_batches_keep_order_and_other_messages_go_at_once() -> None:
    ch = _Channel()
    batch = LineBatcher(ch)  # type: ignore[arg-type]
    sent = [
        RankStarted(0, 10),
        RankOutput(0, "stdout", "a"),
        RankOutput(0, "stdout", "b"),
        RankOutput(1, "stdout", "c"),
        RankOutput(0, "stderr", "d"),
        RankOutput(0, "stdout", 'e {"json"} \x00 é'),
    ]
    for m in sent:
        batch(m)
    assert len(ch.writes) == 1  # the started message; the lines wait for the turn's end
    batch.flush()
    assert len(ch.writes) == 2 and _flat(ch.messages()) == sent
    # Four runs of one (rank, stream), in one `lines` message.
    one = wire.decode(ch.writes[1])
    assert one is not None and one["t"] == "lines" and [run[:2] for run in one["runs"]] == [
        [0, "stdout"], [1, "stdout"], [0, "stderr"], [0, "stdout"],
    ]
    batch(RankOutput(1, "stderr", "last words"))
    batch(RankEvent(1, {"kind": "error", "message": "boom"}))
    batch(RankOutput(1, "stderr", "after the event"))
    batch(RankExit(1, 3))  # an exit never waits, and the lines before it go first
    batch.flush()  # nothing left: no empty write
    assert len(ch.writes) == 4
    assert _flat(ch.messages())[len(sent):] == [
        RankOutput(1, "stderr", "last words"),
        RankEvent(1, {"kind": "error", "message": "boom"}),
        RankOutput(1, "stderr", "after the event"),
        RankExit(1, 3),
    ]


def test_a_full_batch_goes_without_waiting_for_the_turn() -> None:
    from zerorun.launch import agent

    ch = _Channel()
    batch = LineBatcher(ch)  # type: ignore[arg-type]
    lines = [RankOutput(2, "stdout", f"line {i}") for i in range(agent._BATCH_LINES + 5)]
    for m in lines:
        batch(m)
    assert len(ch.writes) == 1
    batch.flush()
    assert _flat(ch.messages()) == lines
    big = RankOutput(2, "stdout", "x" * (agent._BATCH_BYTES + 1))
    batch(big)
    assert len(ch.writes) == 3 and _flat(ch.messages())[-1] == big


@pytest.mark.parametrize(
    "bad",
    [
        {"t": "lines", "runs": [[0, "stdin", ["x"]]]},
        {"t": "lines", "runs": [[0, "stdout", "x"]]},
        {"t": "lines", "runs": [["r", "stdout", []]]},
        {"t": "lines", "runs": [[0, "stdout"]]},
        {"t": "lines", "runs": 3},
        {"t": "lines"},
    ],
)
def test_malformed_lines_raise_what_the_runner_reports(bad: dict) -> None:
    with pytest.raises((KeyError, TypeError, ValueError)):
        wire.messages_from_wire(bad)


def test_a_real_agent_sends_every_line_in_order_and_the_last_before_the_exit(tmp_path: Path) -> None:
    """A real agent process and two real ranks flooding stdout and stderr (test_output_path's
    rank program): every line arrives whole and in order per stream, the unterminated last
    bytes too, each rank's exit after its lines; batched (far fewer messages than lines)."""
    from _launch import REPO, base_env
    from test_output_path import _RANK

    from zerorun.launch.hosts import Host
    from zerorun.launch.plan import DeviceInfo, LaunchOptions, Target, build_plan

    script = tmp_path / "flood.py"
    script.write_text(_RANK)
    options = LaunchOptions(target=Target(script=str(script)), device="cpu")
    plan = build_plan(
        options, [Host("localhost", (0, 1))], DeviceInfo(gpus=(), cores=2), master_port=29500,
        run_id="agent-lines", cwd=str(tmp_path),
    )
    env, _tag = base_env()
    agent = subprocess.Popen(
        [sys.executable, "-m", "zerorun.launch.agent"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, env=env, cwd=REPO,
    )
    assert agent.stdin is not None and agent.stdout is not None
    agent.stdin.write(wire.encode("plan", plan=wire.plan_to_dict(plan, 0), node_rank=0, heartbeat_s=0.5,
                                  heartbeat_timeout_s=120))
    agent.stdin.flush()
    got: list[object] = []
    kinds: list[str] = []
    exits = 0
    deadline = time.monotonic() + 60
    try:
        for line in agent.stdout:  # heartbeats every 0.5 s: the deadline is checked
            if time.monotonic() > deadline:
                break
            msg = wire.decode(line)
            if msg is None or msg["t"] == "hb":
                continue
            kinds.append(msg["t"])
            got.extend(wire.messages_from_wire(msg))
            exits += msg["t"] == "exit"
            if exits == 2:
                break
    finally:
        agent.stdin.close()  # EOF: the agent kills what is left and exits
        agent.wait(timeout=30)
    assert exits == 2
    for rank in (0, 1):
        mine = [m for m in got if getattr(m, "rank", None) == rank]
        assert isinstance(mine[-1], RankExit) and mine[-1].returncode == (3 if rank else 0)
        out = [t for m in mine if isinstance(m, RankLines) and m.stream == "stdout" for t in m.lines]
        err = [t for m in mine if isinstance(m, RankLines) and m.stream == "stderr" for t in m.lines]
        assert out == [f"out {rank} {i} " + "x" * 10 for i in range(20_000)] + ["partial-end", f"unterminated {rank}"]
        assert err == [f"err {rank} {i}" for i in range(100)]
    assert "out" not in kinds and kinds.count("lines") < 2_000  # 40,204 lines
