"""Agents over plain byte-stream links: one reader thread for every node, one heartbeat thread.

An SSH job gives each node its own paramiko transport, channel reader threads and heartbeat
thread (~5 threads per node). A *link* is any connected stream socket (Unix or TCP) that
carries the `launch/wire.py` protocol to one node agent; how it was connected is the
transport's business (the scale simulation connects to its agent hosts, srun-started agents
can dial in to the launcher). On the launcher's side:

- `Link`: one agent's socket: thread-safe `send`, the decoded messages (a queue until a
  handler takes over), `last_heard`, non-protocol lines kept as `stderr_tail`;
- `LinkHub`: ONE selector thread reads every link, cuts lines, decodes them and hands them
  to the link's handler; ONE thread ticks every runner's heartbeat (sends it, watches silence).
  Launcher threads stay at 2 + the supervisor, whatever the node count.

The runner of an agent over a link is `launch/agent_runner.AgentRunner`, the same as over SSH.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from zerorun.launch import wire
from zerorun.launch.agent_runner import AgentInbox

__all__ = ["Link", "LinkHub"]

_READ_SIZE = 1 << 16
# A send blocked this long means the agent stopped reading: the link counts as broken.
_SEND_TIMEOUT_S = 10.0


class Link(AgentInbox):
    """One agent's end of the launcher: a connected stream socket carrying wire messages (an
    `agent_runner.AgentChannel`)."""

    def __init__(self, name: str, sock: socket.socket, *, display: str | None = None) -> None:
        super().__init__()
        self.name = name
        self.display = display or name
        self.sock = sock
        sock.settimeout(_SEND_TIMEOUT_S)  # recv is only called when the selector says ready
        self.closed = threading.Event()
        self._send_lock = threading.Lock()
        self._buf = b""
        self._hub: LinkHub | None = None  # the hub reading this link (set by LinkHub.add)

    @property
    def route(self) -> str:
        return f"the link to {self.display}"

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

    def beat(self, tick: Callable[[float], None], every: float) -> None:
        """`tick` is called by the hub's heartbeat thread, at the hub's interval (`every` is the
        SSH channel's business: one thread per node there)."""
        del every
        assert self._hub is not None, "a link is read by a hub (LinkHub.add) before a runner uses it"
        self._hub.beat(tick)

    def silent_for(self, now: float) -> float:
        # Up to the reader's last round: a launcher starved of CPU (its reader not running)
        # does not take its own stall for silent nodes.
        round_at = self._hub.round_at if self._hub is not None else now
        return min(now, round_at) - self.last_heard

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

    def _on_data(self, data: bytes) -> None:
        self.last_heard = time.monotonic()
        *lines, self._buf = (self._buf + data).split(b"\n")
        for line in lines:
            self.take_line(line)


class LinkHub:
    """Reads every registered link on one thread; ticks every registered heartbeat on
    another. `close()` stops both (the links themselves are closed by their owners)."""

    def __init__(self, *, heartbeat_s: float = 1.0) -> None:
        self.heartbeat_s = heartbeat_s
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._beating: list[Callable[[float], None]] = []
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

    def beat(self, tick: Callable[[float], None]) -> None:
        """Call `tick(now)` every `heartbeat_s` on the heartbeat thread from now on."""
        with self._beat_lock:
            self._beating.append(tick)

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
                link.deliver(None)  # end of stream

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            now = time.monotonic()
            with self._beat_lock:
                ticks = list(self._beating)
            for tick in ticks:
                tick(now)

