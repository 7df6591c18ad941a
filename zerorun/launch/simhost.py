"""A process that hosts many simulated nodes: `python -m zerorun.launch.simhost`.

Each node is a real `launch.agent.Agent` (same message handling, heartbeat watchdog, death
rules, preflight `hello`) whose runner is a `launch.synthetic.SyntheticRunner`, reached over
its own Unix-socket connection carrying the `launch/wire.py` protocol. The CI machine has 2
cores, so one process hosts many agents on ONE thread: a selector loop reads every agent's
connection and drives every agent's and runner's clock.

Started by `launch/simulate.py`. Arguments: `--socket PATH` (listen here), `--scenario FILE`
(a `Scenario` as JSON). A connection's first line is `{"t": "attach", "node_rank": N,
"attempt": A}`; the host answers `{"t": "attached"}` after the scenario's connect latency (the
stand-in for an SSH handshake), or closes the connection (a refused connect) while the node
still has failures to inject. From then on the connection is that node's agent channel.

stdin is the launcher's leash: at EOF (job over, or launcher dead) the host waits briefly for
the agents to see their own EOFs, counts the synthetic ranks still alive (left behind), kills
them and exits, printing one JSON line of totals on stdout.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import selectors
import socket
import sys
import time
from typing import Any

from zerorun.launch import wire
from zerorun.launch.agent import Agent, hello
from zerorun.launch.synthetic import Scenario, SyntheticRunner

__all__ = ["main"]

_TICK_S = 0.02
_LEASH_GRACE_S = 3.0


class _SimChannel:
    """The agent's channel, muted while its node is "silent" (a dropped link)."""

    def __init__(self, sock: socket.socket, on_broken: Any) -> None:
        self.sock = sock
        self.on_broken = on_broken
        self.muted = False

    def send(self, kind: str, **fields: Any) -> None:
        self.write(wire.encode(kind, **fields))

    def write(self, encoded: bytes) -> None:
        if self.muted:
            return
        try:
            self.sock.sendall(encoded)
        except OSError:
            self.on_broken("the channel to the launcher broke")


class _Node:
    def __init__(self, host: Host, node_rank: int, sock: socket.socket) -> None:
        self.host = host
        self.node_rank = node_rank
        self.sock = sock
        self.buf = b""
        self.closed = False
        self.silent = False
        self.plan_at: float | None = None
        self.agent = Agent(sock.fileno(), exit=self._exit, runner_factory=self._runner)
        self.channel = _SimChannel(sock, self.agent.die)
        self.agent.channel = self.channel  # type: ignore[assignment]
        self.runner: SyntheticRunner | None = None

    def _runner(self, plan: Any, node: Any) -> SyntheticRunner:
        self.plan_at = time.monotonic()
        self.runner = SyntheticRunner(plan, node, self.host.scenario)
        self.host.ranks_started += len(node.ranks)
        return self.runner

    def _exit(self, code: int) -> None:
        del code
        if not self.silent:  # a silent node's link stays open but mute until the launcher hangs up
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.host.sel.unregister(self.sock)
        except (KeyError, ValueError):
            pass
        self.sock.close()

    def on_data(self, data: bytes) -> None:
        *lines, self.buf = (self.buf + data).split(b"\n")
        if self.silent:
            return
        self.agent.last_heard = time.monotonic()
        for line in lines:
            msg = wire.decode(line)
            if msg is None:
                continue
            if msg["t"] == "preflight" and self.node_rank in self.host.scenario.version_mismatch:
                self.channel.send("hello", **{**hello(msg), "version": "0.0.0-other"})
            else:
                self.agent.handle(msg)

    def on_clock(self, now: float) -> None:
        sc = self.host.scenario
        if self.plan_at is not None and not self.agent.dead:
            at = now - self.plan_at
            if not self.silent and self.node_rank in sc.silent and at >= sc.silent[self.node_rank]:
                self.silent = self.channel.muted = True
            if self.node_rank in sc.drop and at >= sc.drop[self.node_rank]:
                self.channel.muted = True  # nothing more gets through, not even the ranks' exits
                self.agent.die("the link was cut (simulated)")
                return
        # Only when it has something to do: polling 125 idle runners 50 times a second would
        # cost this host more than the lines themselves.
        if self.runner is not None and not self.agent.dead and now >= self.runner.next_due:
            self.runner.tick(now)


class Host:
    def __init__(self, sock_path: str, scenario: Scenario) -> None:
        self.scenario = scenario
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(sock_path)
        self.listener.listen(1024)
        self.sel.register(self.listener, selectors.EVENT_READ, "listen")
        self.sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "leash")
        self.nodes: list[_Node] = []
        self.pending: dict[socket.socket, bytes] = {}
        self.timers: list[tuple[float, int, socket.socket, int]] = []
        self.ranks_started = 0
        self.refused = 0
        self._seq = 0
        self._next_beat = 0.0

    def serve(self) -> dict[str, Any]:
        leash_at: float | None = None
        while True:
            now = time.monotonic()
            wait = _TICK_S
            if self.timers:
                wait = max(0.0, min(wait, self.timers[0][0] - now))
            for key, _ in self.sel.select(timeout=wait):
                if key.data == "listen":
                    conn, _ = self.listener.accept()
                    self.pending[conn] = b""
                    self.sel.register(conn, selectors.EVENT_READ, "pending")
                elif key.data == "leash":
                    if not os.read(sys.stdin.fileno(), 4096):
                        self.sel.unregister(sys.stdin.fileno())
                        leash_at = time.monotonic()
                elif key.data == "pending":
                    self._on_pending(key.fileobj)  # type: ignore[arg-type]
                else:
                    self._on_node(key.data)
            now = time.monotonic()
            while self.timers and self.timers[0][0] <= now:
                _, _, conn, node_rank = heapq.heappop(self.timers)
                self._attach(conn, node_rank)
            for node in self.nodes:
                node.on_clock(now)
            if now >= self._next_beat:
                self._next_beat = now + 1.0
                for node in self.nodes:
                    if not node.agent.dead:
                        node.agent.tick(now)
            if leash_at is not None and (now - leash_at > _LEASH_GRACE_S or all(n.agent.dead for n in self.nodes)):
                return self._finish()

    def _on_pending(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        buf = self.pending.get(conn, b"") + data
        if not data or b"\n" in buf:
            self.sel.unregister(conn)
            del self.pending[conn]
            msg = wire.decode(buf.split(b"\n", 1)[0]) if data else None
            if msg is None or msg.get("t") != "attach":
                conn.close()
                return
            node_rank, attempt = int(msg["node_rank"]), int(msg.get("attempt", 0))
            if attempt < self.scenario.connect_failures.get(node_rank, 0):
                self.refused += 1
                conn.close()  # the launcher sees a refused connection
                return
            self._seq += 1
            heapq.heappush(self.timers, (time.monotonic() + self.scenario.connect_latency_s, self._seq, conn, node_rank))
        else:
            self.pending[conn] = buf

    def _attach(self, conn: socket.socket, node_rank: int) -> None:
        try:
            conn.sendall(wire.encode("attached"))
        except OSError:
            conn.close()
            return
        node = _Node(self, node_rank, conn)
        self.nodes.append(node)
        self.sel.register(conn, selectors.EVENT_READ, node)

    def _on_node(self, node: _Node) -> None:
        try:
            data = node.sock.recv(1 << 16)
        except OSError:
            data = b""
        if data:
            node.on_data(data)
            return
        node.close()
        if not node.agent.dead:
            node.agent.die("the launcher closed the connection; killed this node's ranks")

    def _finish(self) -> dict[str, Any]:
        left = sum(n.runner.alive() for n in self.nodes if n.runner is not None)
        agents_left = sum(1 for n in self.nodes if not n.agent.dead)
        for n in self.nodes:
            if not n.agent.dead:
                n.agent.die("the launcher went away")
            n.close()
        return {
            "agents": len(self.nodes),
            "agents_left": agents_left,
            "ranks_started": self.ranks_started,
            "ranks_left": left,
            "refused": self.refused,
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zerorun.launch.simhost")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--scenario", required=True)
    args = parser.parse_args(argv)
    with open(args.scenario, encoding="utf-8") as fh:
        scenario = Scenario.from_json(json.load(fh))
    if scenario.host_nice > 0:
        os.nice(scenario.host_nice)
    # What the agent imports when its plan arrives, once for all the agents of this process now:
    # a start-up measurement is then the launcher's, not this host's import time.
    import zerorun.launch.local  # noqa: F401
    import zerorun.launch.messages  # noqa: F401
    host = Host(args.socket, scenario)
    print("ready", flush=True)
    totals = host.serve()
    print(json.dumps(totals), flush=True)


if __name__ == "__main__":
    main()
