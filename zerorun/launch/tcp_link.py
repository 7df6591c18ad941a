"""TCP connections for `launch/link.py`'s links: listen, accept with a deadline, connect with
retries. Stdlib only (no torch, no paramiko).

Used by the per-node rendezvous (`launch/rendezvous.py`) and by the transports whose agents
dial back to the launcher over TCP (Slurm's and MPI's node agents) instead of talking over an
SSH channel. Every connection becomes a `link.Link` registered with a `link.LinkHub` (whose
one reader thread decodes its messages: into `link.messages` until a handler takes over).

- `listen(port, host="")` -> a listening socket (SO_REUSEADDR; port 0 picks one);
- `accept(listener, hub, deadline)` -> a `Link`, or None when the deadline passes first;
- `connect(host, port, hub, deadline)` retries refused/unreachable connections until the
  deadline (the other side may start later), then raises `OSError` with the last reason.
"""

from __future__ import annotations

import socket
import time

from zerorun.launch.link import Link, LinkHub

__all__ = ["listen", "accept", "connect"]


def _link(sock: socket.socket, hub: LinkHub, name: str) -> Link:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        peer = sock.getpeername()
        display = f"{name} ({peer[0]})"
    except OSError:
        display = name
    link = Link(name, sock, display=display)
    hub.add(link)
    return link


def listen(port: int, host: str = "") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def accept(listener: socket.socket, hub: LinkHub, deadline: float, name: str = "link") -> Link | None:
    """The next connection, or None when `deadline` (monotonic) passes first."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        listener.settimeout(min(left, 1.0))
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        sock.settimeout(None)
        return _link(sock, hub, name)


def connect(host: str, port: int, hub: LinkHub, deadline: float, name: str = "link") -> Link:
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise last or OSError(f"no connection to {host}:{port}")
        try:
            sock = socket.create_connection((host, port), timeout=min(max(left, 0.1), 5.0))
            sock.settimeout(None)
            return _link(sock, hub, name)
        except OSError as err:  # refused (not listening yet), unreachable, DNS not there yet
            last = err
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
