"""launch/link.py: links read by one hub thread."""

from __future__ import annotations

import socket

from zerorun.launch import wire
from zerorun.launch.link import Link, LinkHub


def test_a_closed_links_fd_can_be_reused_by_the_next_link() -> None:
    """Closing a link the hub reads lets go of its fd in the hub's selector: the next accepted
    socket often gets the same number (before: KeyError 'already registered' from add(), e.g.
    after the dial-in turned a stranger away)."""
    hub = LinkHub()
    ends: list[socket.socket] = []
    try:
        for i in range(3):
            ours, theirs = socket.socketpair()
            ends.append(theirs)
            link = Link(f"l{i}", ours)
            hub.add(link)
            theirs.sendall(wire.encode("hello", n=i))
            assert link.messages.get(timeout=5) == {"t": "hello", "n": i}
            link.close()
    finally:
        hub.close()
        for s in ends:
            s.close()
