"""Agents over plain byte-stream links: one reader thread for every node, one heartbeat thread.

An SSH job gives each node its own paramiko transport, channel reader threads and heartbeat
thread (~5 threads per node). A *link* is any connected stream socket (Unix or TCP) that
carries the `launch/wire.py` protocol to one node agent; how it was connected is the
transport's business (the scale simulation connects to its agent hosts, srun-started agents
can dial in to the launcher). On the launcher's side:

- `Link`: one agent's socket: thread-safe `send`, the decoded messages (a queue until a
  handler takes over), `last_heard`, non-protocol lines kept as `stderr_tail`;
- `LinkHub`: ONE selector thread reads every link, cuts lines, decodes them and hands them
  to the link's handler; ONE thread sends heartbeats and watches silence for every runner.
  Launcher threads stay at 2 + the supervisor, whatever the node count;
- `LinkRunner`: the `NodeRunner` (Contract 5) that drives one agent over a link: the same
  messages, fail-fast inputs (`NodeLost` on EOF or silence) and heartbeat rules as
  `launch/remote.SshRunner`.
"""

from __future__ import annotations

import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from zerorun.errors import LaunchError
from zerorun.launch import wire
from zerorun.launch.messages import NodeLost, RankExit, Sink

__all__ = ["Link", "LinkHub", "LinkRunner"]

_READ_SIZE = 1 << 16
# A send blocked this long means the agent stopped reading: the link counts as broken.
_SEND_TIMEOUT_S = 10.0
# After a `kill`, how long `close` waits for the agent to report its ranks' exits.
_CLOSE_WAIT_S = 2.0

Handler = Callable[[dict[str, Any] | None], None]


class Link:
    """One agent's end of the launcher: a connected stream socket carrying wire messages."""

    def __init__(self, name: str, sock: socket.socket, *, display: str | None = None) -> None:
        self.name = name
        self.display = display or name
        self.sock = sock
        sock.settimeout(_SEND_TIMEOUT_S)  # recv is only called when the selector says ready
        self.last_heard = time.monotonic()
        self.stderr_tail: list[str] = []
        self.messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.closed = threading.Event()
        self._handler: Handler | None = None
        self._handler_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._buf = b""
        self._hub: LinkHub | None = None  # the hub reading this link (set by LinkHub.add)

    def send(self, kind: str, **fields: Any) -> bool:
        return self.send_bytes(wire.encode(kind, **fields))

    def send_bytes(self, data: bytes) -> bool:
        """False when the link is gone (the caller reports the node)."""
        with self._send_lock:
            if self.closed.is_set():
                return False
            try:
                self.sock.sendall(data)
                return True
            except OSError:
                return False

    def set_handler(self, handler: Handler) -> None:
        """From now on, messages go to `handler` (on the hub's thread) instead of the queue;
        whatever is queued is handed over first, in order. `None` means end of stream."""
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

    def close(self) -> None:
        """EOF for the agent (it kills whatever is left of its ranks and exits)."""
        with self._send_lock:
            if self.closed.is_set():
                return
            self.closed.set()
        if self._hub is not None:
            # Before the socket closes: the next accepted socket may get the same fd number,
            # which the hub's selector would otherwise still hold for this link.
            self._hub.forget(self)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    # -- called by the hub's reader thread -------------------------------------------------

    def _deliver(self, msg: dict[str, Any] | None) -> None:
        with self._handler_lock:
            if self._handler is None:
                self.messages.put(msg)
            else:
                self._handler(msg)

    def _on_data(self, data: bytes) -> None:
        self.last_heard = time.monotonic()
        *lines, self._buf = (self._buf + data).split(b"\n")
        for line in lines:
            msg = wire.decode(line)
            if msg is None:
                text = line.decode("utf-8", "replace").rstrip()
                if text:
                    self.keep_stderr(text)
                continue
            self._deliver(msg)


class LinkHub:
    """Reads every registered link on one thread; beats every registered runner's heart on
    another. `close()` stops both (the links themselves are closed by their owners)."""

    def __init__(self, *, heartbeat_s: float = 1.0) -> None:
        self.heartbeat_s = heartbeat_s
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._beating: list[LinkRunner] = []
        # When the reader last began a round: every link with data waiting then is read in that
        # round. Silence is measured up to here, so a launcher starved of CPU (its reader thread
        # not running) does not mistake its own stall for silent nodes.
        self.round_at = time.monotonic()
        self._beat_lock = threading.Lock()
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="zerorun-link-reader", daemon=True)
        self._beater = threading.Thread(target=self._beat_loop, name="zerorun-link-heartbeat", daemon=True)
        self._reader.start()
        self._beater.start()

    def add(self, link: Link) -> None:
        link._hub = self  # noqa: SLF001 - the link forgets itself here when it closes
        self._sel.register(link.sock, selectors.EVENT_READ, link)
        self._wake_w.send(b"x")  # epoll picks it up anyway; this keeps the loop honest

    def forget(self, link: Link) -> None:
        """Stop reading `link` (it is closing; its end of stream is delivered by the reader
        only if it saw it first)."""
        try:
            self._sel.unregister(link.sock)
        except (KeyError, ValueError, OSError):
            pass

    def beat(self, runner: LinkRunner) -> None:
        with self._beat_lock:
            self._beating.append(runner)

    def close(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._reader.join(timeout=2.0)
        self._beater.join(timeout=2.0)
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            self.round_at = time.monotonic()
            try:
                ready = self._sel.select(timeout=0.5)
            except (OSError, ValueError):  # closed under us
                return
            for key, _ in ready:
                link: Link | None = key.data
                if link is None:
                    try:
                        self._wake_r.recv(4096)
                    except OSError:
                        pass
                    continue
                try:
                    data = link.sock.recv(_READ_SIZE)
                except (BlockingIOError, InterruptedError, TimeoutError):
                    continue
                except OSError:
                    data = b""
                if data:
                    link._on_data(data)  # noqa: SLF001 - the hub is the link's reader
                    continue
                try:
                    self._sel.unregister(link.sock)
                except (KeyError, ValueError):
                    pass
                link._deliver(None)  # noqa: SLF001 - end of stream

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            now = time.monotonic()
            with self._beat_lock:
                runners = list(self._beating)
            for runner in runners:
                runner._tick(now)  # noqa: SLF001 - the hub drives the runner's heartbeat


class LinkRunner:
    """A `NodeRunner` for one node whose agent is at the other end of `link`."""

    def __init__(
        self,
        plan: Any,
        node: Any,
        link: Link,
        hub: LinkHub,
        *,
        heartbeat_s: float = 1.0,
        heartbeat_timeout_s: float = 10.0,
    ) -> None:
        self.plan = plan
        self.node = node
        self.link = link
        self.hub = hub
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._exited: set[int] = set()
        self._lost = False
        self._done = threading.Event()
        self._sink: Sink | None = None

    def start(self, sink: Sink) -> None:
        self._sink = sink
        sent = self.link.send(
            "plan",
            plan=wire.plan_to_dict(self.plan, self.node.node_rank),
            node_rank=self.node.node_rank,
            heartbeat_s=self.heartbeat_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
        )
        if not sent:
            raise LaunchError(f"the link to {self.link.display} closed before the job started")
        self.link.last_heard = time.monotonic()
        self.link.set_handler(self._on_message)
        self.hub.beat(self)

    def _on_message(self, msg: dict[str, Any] | None) -> None:
        sink = self._sink
        assert sink is not None
        if msg is None:
            if len(self._exited) < len(self.node.ranks):
                tail = "; ".join(self.link.stderr_tail[-3:])
                self._lose(f"the link to {self.link.display} closed" + (f" ({tail})" if tail else ""))
            self._done.set()
            return
        if msg.get("t") == "error":
            self.link.keep_stderr(str(msg.get("message")))
            return
        try:
            m = wire.message_from_wire(msg)
        except (KeyError, TypeError, ValueError):
            self.link.keep_stderr(f"malformed message from the agent: {msg!r}"[:500])
            return
        if m is None:
            return
        if isinstance(m, RankExit):
            self._exited.add(m.rank)
        sink(m)
        if isinstance(m, RankExit) and len(self._exited) == len(self.node.ranks):
            self._done.set()

    def _tick(self, now: float) -> None:
        if self._lost or self.link.closed.is_set():
            return
        silent = min(now, self.hub.round_at) - self.link.last_heard
        if silent > self.heartbeat_timeout_s:
            self._lose(
                f"{self.link.display} is unreachable: no heartbeat from its agent for {silent:.0f} s "
                "(network down or node frozen)"
            )
            self.link.close()
        elif not self.link.send("hb"):
            self._lose(f"the link to {self.link.display} broke")

    def _lose(self, reason: str) -> None:
        if self._lost or self._sink is None or len(self._exited) == len(self.node.ranks):
            return
        self._lost = True
        self._sink(NodeLost(self.node.node_rank, reason))

    def signal(self, sig: int, *, tree: bool = True) -> None:
        self.link.send("signal", sig=int(sig), tree=tree)

    def kill(self) -> None:
        self.link.send("kill")

    def close(self) -> None:
        # Give the agent a moment to report the exits of a kill() just sent (never started:
        # nothing to wait for).
        if self._sink is not None and len(self._exited) < len(self.node.ranks) and not self._lost:
            self._done.wait(_CLOSE_WAIT_S)
        self._done.set()
        self.link.close()
