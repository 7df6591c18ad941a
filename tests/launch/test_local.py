"""launch/local.py: port helpers and cutting rank output into lines."""

from __future__ import annotations

import socket

from zerorun.launch.local import choose_free_port, port_is_free


def test_port_helpers() -> None:
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen(1)
        assert not port_is_free(sock.getsockname()[1])
    port = choose_free_port()
    assert 1024 < port < 32768 and port_is_free(port)


def test_line_cutting_handles_progress_bars() -> None:
    """`\\r` redraws become lines at once; `\\r\\n` split across reads is one line end."""
    from zerorun.launch.local import LocalRunner, _Stream

    got: list[str] = []
    runner = LocalRunner.__new__(LocalRunner)
    runner._sink = lambda msg: got.extend(msg.lines)
    s = _Stream(0, "stdout", -1)
    for piece in (b"epoch 1\n\r 10%|#", b"\r 20%|##\r", b"\ndone\r", b"\n\nutf8 \xc3", b"\xa9\n", b"tail"):
        s.buf += piece
        runner._emit_lines(s)
    assert got == ["epoch 1", " 10%|#", " 20%|##", "done", "", "utf8 \u00e9"]
    assert bytes(s.buf) == b"tail"
