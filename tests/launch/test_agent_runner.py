"""launch/agent_runner.py: one runner over both channel kinds. Every test runs over an SSH
`NodeChannel` (its real reader, writer and heartbeat threads, over a socket in place of
paramiko's channel) and over a `Link` read by a `LinkHub`; the test plays the agent at the other
end of the socket. Real sshd: tests/multinode; real links: test_simulate.py, test_dialin.py."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from _plans import plan_for

from zerorun.launch.agent_runner import AgentRunner
from zerorun.launch.hosts import Host
from zerorun.launch.link import Link, LinkHub
from zerorun.launch.messages import NodeLost, RankExit, RankOutput, RankStarted
from zerorun.launch.ssh import NodeChannel, SshTarget


class _SocketSshChannel:
    """The part of a paramiko Channel `NodeChannel` uses, over a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def exec_command(self, command: str) -> None:
        self.command = command

    def recv(self, n: int) -> bytes:
        return self.sock.recv(n)

    def recv_stderr(self, n: int) -> bytes:
        return b""

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def shutdown_write(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)

    def exit_status_ready(self) -> bool:
        return False


class _SocketSshClient:
    """A paramiko SSHClient whose one session is `_SocketSshChannel`."""

    def __init__(self, sock: socket.socket) -> None:
        self.session = _SocketSshChannel(sock)

    def get_transport(self) -> Any:
        session = self.session

        class Transport:
            def open_session(self) -> _SocketSshChannel:
                return session

        return Transport()

    def close(self) -> None:  # as paramiko's: the channel's recv returns b"" from now on
        try:
            self.session.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


@dataclass
class Setup:
    """A runner of node `n1` (two ranks), its channel, and the agent's end of the socket."""

    runner: AgentRunner
    channel: Any
    agent: socket.socket
    got: list[object]
    event: threading.Event  # set by the sink on NodeLost and on the last RankExit

    def say(self, kind: str, **fields: object) -> None:
        self.agent.sendall((json.dumps({"t": kind, **fields}) + "\n").encode())

    def heard(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Every message the agent has received so far (up to a pause of 0.3 s)."""
        self.agent.settimeout(0.3)
        data = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = self.agent.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            data += chunk
        return [json.loads(line) for line in data.splitlines() if line]


@pytest.fixture(params=["ssh", "link"])
def make(request: pytest.FixtureRequest) -> Iterator[Any]:
    made: list[tuple[Any, socket.socket, LinkHub | None]] = []

    def build(*, heartbeat_s: float = 60.0, heartbeat_timeout_s: float = 60.0, start: bool = True) -> Setup:
        plan = plan_for([Host("n1", (0, 1))])
        ours, agent = socket.socketpair()
        hub = None
        if request.param == "ssh":
            target = SshTarget("n1", "10.0.0.1", 22, "u", (), 1.0)
            channel: Any = NodeChannel("n1", target, _SocketSshClient(ours), "agent")  # type: ignore[arg-type]
        else:
            hub = LinkHub(heartbeat_s=heartbeat_s)
            channel = Link("n1", ours, display="n1 (10.0.0.1)")
            hub.add(channel)
        made.append((channel, agent, hub))
        runner = AgentRunner(plan, plan.nodes[0], channel, heartbeat_s=heartbeat_s, heartbeat_timeout_s=heartbeat_timeout_s)
        got: list[object] = []
        event = threading.Event()

        def sink(m: object) -> None:
            got.append(m)
            if isinstance(m, NodeLost) or (isinstance(m, RankExit) and m.rank == 1):
                event.set()

        if start:
            runner.start(sink)
        return Setup(runner, channel, agent, got, event)

    build.kind = request.param  # type: ignore[attr-defined]
    yield build
    for channel, agent, hub in made:
        channel.close()
        agent.close()
        if hub is not None:
            hub.close()


def _route(make: Any) -> str:
    return "the SSH connection to n1 (10.0.0.1)" if make.kind == "ssh" else "the link to n1 (10.0.0.1)"


def test_the_plan_goes_out_and_the_ranks_messages_come_back(make: Any) -> None:
    """The agent gets its plan (this node's entry only); the ranks' messages reach the sink in
    order; a malformed one and an agent error are kept for the node's error text, and the reader
    goes on (before: a malformed message ended the SSH reader, the job waited for exits forever);
    signal and kill reach the agent; both ranks exited: closing reports nothing lost."""
    s = make()
    s.say("started", rank=0, pid=11)
    s.say("out", rank=0, stream="stdout", line="hello")
    s.say("exit", rank="zero", code=1)
    s.say("error", message="cannot start rank 1")
    s.say("exit", rank=0, code=0)
    s.runner.signal(15)
    s.runner.signal(10, tree=False)
    s.runner.kill()
    s.say("exit", rank=1, code=-9)
    assert s.event.wait(5)
    heard = s.heard()
    assert heard[0]["t"] == "plan" and heard[0]["node_rank"] == 0 and len(heard[0]["plan"]["nodes"]) == 1
    assert [m for m in heard if m["t"] in ("signal", "kill")] == [
        {"t": "signal", "sig": 15, "tree": True}, {"t": "signal", "sig": 10, "tree": False}, {"t": "kill"},
    ]
    assert s.got == [RankStarted(0, 11), RankOutput(0, "stdout", "hello"), RankExit(0, 0), RankExit(1, -9)]
    assert any("malformed message" in line for line in s.channel.stderr_tail)
    assert "cannot start rank 1" in s.channel.stderr_tail
    t0 = time.monotonic()
    s.runner.close()
    assert time.monotonic() - t0 < 1.0 and s.channel.closed.is_set()
    assert s.heard() == [] and not any(isinstance(m, NodeLost) for m in s.got)  # EOF for the agent


def test_the_stream_ending_before_every_exit_is_a_lost_node_named_once(make: Any) -> None:
    s = make()
    s.say("exit", rank=0, code=0)
    s.agent.sendall(b"Killed\n")  # not a protocol line: kept, and named with the loss
    s.agent.shutdown(socket.SHUT_WR)
    assert s.event.wait(5)
    time.sleep(0.2)
    lost = [m for m in s.got if isinstance(m, NodeLost)]
    assert lost == [NodeLost(0, f"{_route(make)} closed (Killed)")]


def test_a_silent_agent_is_a_lost_node_and_its_channel_is_closed(make: Any) -> None:
    s = make(heartbeat_s=0.1, heartbeat_timeout_s=0.6)
    t0 = time.monotonic()
    assert s.event.wait(5)
    assert 0.5 < time.monotonic() - t0 < 3.0
    (lost,) = [m for m in s.got if isinstance(m, NodeLost)]
    assert lost.reason.startswith("n1 (10.0.0.1) is unreachable: no heartbeat from its agent for")
    assert s.channel.closed.is_set()
    assert sum(m["t"] == "hb" for m in s.heard()) >= 2  # heartbeats went out meanwhile


def test_a_talking_agent_is_not_lost(make: Any) -> None:
    s = make(heartbeat_s=0.1, heartbeat_timeout_s=0.6)
    for _ in range(12):
        s.say("hb")
        time.sleep(0.1)
    assert s.got == []


def test_a_runner_never_started_closes_at_once(make: Any) -> None:
    s = make(start=False)
    t0 = time.monotonic()
    s.runner.close()
    assert time.monotonic() - t0 < 1.0  # not the 2 s wait for exits of ranks that never ran
    assert s.channel.closed.is_set()
    assert s.heard() == []  # the agent's end sees EOF: it exits


def test_a_plan_that_cannot_be_sent_is_a_launch_error(make: Any) -> None:
    from zerorun.errors import LaunchError

    s = make(start=False)
    s.channel.close()
    with pytest.raises(LaunchError, match=re.escape(f"{_route(make)} closed before the job started")):
        s.runner.start(lambda m: None)
