"""The `NodeRunner` (Contract 5) of a node agent at the other end of a channel: one runner, two
kinds of channel.

A node agent (`launch/agent.py`) speaks `launch/wire.py` with the launcher over whatever the
transport connected:
- an SSH exec channel (`launch/ssh.NodeChannel`): read by its own threads, heartbeats from one
  thread per node (`launch/remote.py` makes these);
- a link (`launch/link.Link`): a stream socket read, with every other link, by a `LinkHub`'s one
  reader thread, whose heartbeat thread ticks every runner (the scale simulation, the Slurm/MPI
  dial-in).

What a runner does with its channel is the same for both, and is defined here once: send the
plan, turn the agent's messages into runner messages for the supervisor's sink, report the node
lost (`NodeLost`) when the stream ends before every rank exited, when the agent falls silent for
`heartbeat_timeout_s` or when a heartbeat cannot be sent, forward signal/kill, and on close give
the agent a moment to report the exits of a kill before ending the stream (the agent then kills
whatever is left and exits).

`AgentInbox` is the part both channel kinds share: the agent's decoded messages, queued until a
runner takes them over, the agent's non-protocol lines, and when it was last heard.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from zerorun.errors import LaunchError
from zerorun.launch import wire
from zerorun.launch.messages import NodeLost, RankExit, Sink

__all__ = ["AgentChannel", "AgentInbox", "AgentRunner", "Handler"]

# After a `kill`, how long `close` waits for the agent to report its ranks' exits.
CLOSE_WAIT_S = 2.0

Handler = Callable[[dict[str, Any] | None], None]


class AgentInbox:
    """One agent's messages on the launcher's side, whatever carries them: decoded messages in
    `messages` (None = end of stream) until `set_handler` hands them to a runner, `last_heard`
    (any line counts), and the agent's lines that are not protocol messages (a login banner, a
    Python error before the agent ran) in `stderr_tail`."""

    def __init__(self) -> None:
        self.messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.stderr_tail: list[str] = []
        self.last_heard = time.monotonic()
        self._handler: Handler | None = None
        self._handler_lock = threading.Lock()

    def set_handler(self, handler: Handler) -> None:
        """From now on, messages go to `handler` (on the channel's reader thread) instead of the
        queue; whatever is queued is handed over first, in order."""
        with self._handler_lock:
            while True:
                try:
                    handler(self.messages.get_nowait())
                except queue.Empty:
                    break
            self._handler = handler

    def keep_stderr(self, text: str) -> None:
        self.stderr_tail.append(text)
        del self.stderr_tail[:-40]

    def take_line(self, line: bytes) -> None:
        """Called by the channel's reader with each line from the agent (`last_heard` is the
        reader's business: any data counts)."""
        msg = wire.decode(line)
        if msg is None:
            text = line.decode("utf-8", "replace").rstrip()
            if text:
                self.keep_stderr(text)
            return
        self.deliver(msg)

    def deliver(self, msg: dict[str, Any] | None) -> None:
        """Called by the channel's reader: one decoded message, or None at the end of the stream."""
        with self._handler_lock:
            if self._handler is None:
                self.messages.put(msg)
            else:
                self._handler(msg)


class AgentChannel(Protocol):
    """What `AgentRunner` needs of a channel (`ssh.NodeChannel`, `link.Link`)."""

    messages: queue.Queue[dict[str, Any] | None]
    stderr_tail: list[str]
    last_heard: float
    closed: threading.Event

    @property
    def display(self) -> str:
        """The node as messages name it: `node1 (10.0.0.1)`."""
        ...

    @property
    def route(self) -> str:
        """The channel as messages name it: `the SSH connection to node1 (10.0.0.1)`."""
        ...

    def send(self, kind: str, **fields: Any) -> bool: ...  # False: the channel is gone
    def set_handler(self, handler: Handler) -> None: ...
    def keep_stderr(self, text: str) -> None: ...
    def beat(self, tick: Callable[[float], None], every: float) -> None:
        """Call `tick(time.monotonic())` about every `every` seconds until the channel closes."""
        ...

    def silent_for(self, now: float) -> float:
        """Seconds the agent has been silent at `now`, as far as the reader could tell."""
        ...

    def close(self) -> None: ...  # EOF for the agent; idempotent


class AgentRunner:
    """A `NodeRunner` for one node whose agent is at the other end of `channel`."""

    def __init__(
        self,
        plan: Any,
        node: Any,
        channel: AgentChannel,
        *,
        heartbeat_s: float = 1.0,
        heartbeat_timeout_s: float = 10.0,
    ) -> None:
        self.plan = plan
        self.node = node
        self.channel = channel
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._exited: set[int] = set()
        self._lost = False
        self._lose_lock = threading.Lock()
        self._ended = False  # the stream ended
        self._done = threading.Event()  # the stream ended, or every rank exited
        self._sink: Sink | None = None

    def start(self, sink: Sink) -> None:
        self._sink = sink
        sent = self.channel.send(
            "plan",
            plan=wire.plan_to_dict(self.plan, self.node.node_rank),
            node_rank=self.node.node_rank,
            heartbeat_s=self.heartbeat_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
        )
        if not sent:
            raise LaunchError(f"{self.channel.route} closed before the job started")
        self.channel.last_heard = time.monotonic()
        self.channel.set_handler(self._on_message)
        self.channel.beat(self._tick, self.heartbeat_s)

    def _on_message(self, msg: dict[str, Any] | None) -> None:
        sink = self._sink
        assert sink is not None
        if msg is None:
            self._ended = True
            if len(self._exited) < len(self.node.ranks):
                tail = "; ".join(self.channel.stderr_tail[-3:])
                self._lose(f"{self.channel.route} closed" + (f" ({tail})" if tail else ""))
            self._done.set()
            return
        if msg.get("t") == "error":
            self.channel.keep_stderr(str(msg.get("message")))
            return
        try:
            got = wire.messages_from_wire(msg)  # a `lines` batch: several
        except (KeyError, TypeError, ValueError):
            # Said, not raised: an exception here would end the channel's reader, and the
            # node's exits would never reach the supervisor.
            self.channel.keep_stderr(f"malformed message from the agent: {msg!r}"[:500])
            return
        for m in got:
            if isinstance(m, RankExit):
                self._exited.add(m.rank)
            sink(m)
            if isinstance(m, RankExit) and len(self._exited) == len(self.node.ranks):
                self._done.set()

    def _tick(self, now: float) -> None:
        if self._lost or self._ended or self.channel.closed.is_set():
            return
        silent = self.channel.silent_for(now)
        if silent > self.heartbeat_timeout_s:
            self._lose(
                f"{self.channel.display} is unreachable: no heartbeat from its agent for {silent:.0f} s "
                "(network down or node frozen)"
            )
            self.channel.close()
        elif not self.channel.send("hb"):
            self._lose(f"{self.channel.route} broke")

    def _lose(self, reason: str) -> None:
        # The reader (end of stream) and the heartbeat (silence) may both get here: one report.
        with self._lose_lock:
            if self._lost or self._sink is None or len(self._exited) == len(self.node.ranks):
                return
            self._lost = True
        self._sink(NodeLost(self.node.node_rank, reason))

    def signal(self, sig: int, *, tree: bool = True) -> None:
        self.channel.send("signal", sig=int(sig), tree=tree)

    def kill(self) -> None:
        self.channel.send("kill")

    def close(self) -> None:
        # Give the agent a moment to report the exits of a kill() just sent (never started:
        # nothing to wait for).
        if self._sink is not None and len(self._exited) < len(self.node.ranks) and not self._lost:
            self._done.wait(CLOSE_WAIT_S)
        self._done.set()
        self.channel.close()  # EOF for the agent: it kills whatever is left and exits
