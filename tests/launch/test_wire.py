"""launch/wire.py: the launcher<->agent line codec and the plan sent over it."""

from __future__ import annotations

from zerorun.launch import wire
from zerorun.launch.hosts import parse_hostfile_text
from zerorun.launch.plan import DeviceInfo, LaunchOptions, Target, build_plan


def test_wire_lines_and_banners() -> None:
    line = wire.encode("out", rank=3, stream="stdout", line="héllo {json} \x00")
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert wire.decode(line) == {"t": "out", "rank": 3, "stream": "stdout", "line": "héllo {json} \x00"}
    assert wire.decode(b"Welcome to node1! Last login: ...") is None
    assert wire.decode(b"[1, 2]") is None and wire.decode(b'{"no": "type"}') is None


def test_plan_round_trips_through_the_wire() -> None:
    hosts = parse_hostfile_text("n1 slots=2 GLOO_SOCKET_IFNAME=eth9\nn2 slots=1\n")
    opts = LaunchOptions(target=Target(script="train.py", args=("--x", "a b", "$(id)")), device="cpu")
    plan = build_plan(
        opts,
        hosts,
        DeviceInfo(gpus=(), cores=8),
        master_port=29500,
        run_id="r1",
        config_json='{"a": 1}',
        node_env={"n1": {"NCCL_DEBUG": "INFO"}},
        cwd="/work",
    )
    data = wire.decode(wire.encode("plan", plan=wire.plan_to_dict(plan)))
    assert data is not None
    again = wire.plan_from_dict(data["plan"])
    assert again == plan
    assert again.rank_env(again.nodes[1].ranks[0]) == plan.rank_env(plan.nodes[1].ranks[0])
    # Unknown fields from a newer launcher are ignored, not fatal.
    extra = wire.plan_to_dict(plan) | {"future_field": 1}
    assert wire.plan_from_dict(extra) == plan


def test_rank_messages_round_trip_and_malformed_ones_raise() -> None:
    import pytest

    from zerorun.launch.messages import NodeLost, RankEvent, RankExit, RankOutput, RankStarted

    for m in (
        RankOutput(3, "stderr", "Traceback ..."),
        RankEvent(1, {"kind": "memory", "rss": 5}),
        RankStarted(0, 4242),
        RankExit(7, -9),
    ):
        encoded = wire.message_to_wire(m)
        assert encoded is not None
        msg = wire.decode(wire.encode(encoded[0], **encoded[1]))
        assert msg is not None and wire.message_from_wire(msg) == m
    assert wire.message_to_wire(NodeLost(0, "gone")) is None
    assert wire.message_from_wire({"t": "hb"}) is None
    for bad in (
        {"t": "exit", "rank": 1},  # no code
        {"t": "out", "rank": "x", "stream": "stdout", "line": ""},
        {"t": "out", "rank": 1, "stream": "stdin", "line": ""},
        {"t": "event", "rank": 1, "event": [1, 2]},
    ):
        with pytest.raises((KeyError, TypeError, ValueError)):
            wire.message_from_wire(bad)


def test_the_preflight_exchange() -> None:
    """One preflight for every transport: the fields sent, the hello awaited, its problems."""
    import queue
    import time

    from zerorun._version import __version__

    fields = wire.preflight_fields(check_port=29500, pick_port=False, script="train.py")
    assert fields == {"version": __version__, "protocol": wire.PROTOCOL_VERSION, "check_port": 29500,
                      "pick_port": False, "script": "train.py"}  # fmt: skip
    q: queue.Queue[dict | None] = queue.Queue()
    hello = {"t": "hello", "version": "1.0", "protocol": wire.PROTOCOL_VERSION, "port": 1}
    for m in ({"t": "hb"}, hello):
        q.put(m)
    assert wire.wait_hello(q, time.monotonic() + 5) == hello
    q.put(None)
    assert wire.wait_hello(q, time.monotonic() + 5) is None  # closed
    t0 = time.monotonic()
    assert wire.wait_hello(q, t0 + 0.1) is None and time.monotonic() - t0 >= 0.1  # silent
    assert wire.hello_problem(hello, version="1.0", python="py") is None
    assert wire.hello_problem(hello | {"error": "port busy"}, version="1.0", python="py") == ("preflight", "port busy")
    busy = hello | {"error": "port busy", "error_kind": "port"}  # the agent says which (the table's problem column)
    assert wire.hello_problem(busy, version="1.0", python="py") == ("port", "port busy")
    old = wire.hello_problem(hello, version="2.0", python="/py", hint=" (or --remote_python)")
    assert old == ("version", "/py there imports zerorun 1.0, this launcher is zerorun 2.0. "
                   "Install the same version on every node (or --remote_python).")  # fmt: skip
    assert wire.hello_problem(hello | {"protocol": 0}, version="1.0", python="py") is not None
