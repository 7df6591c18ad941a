"""zerorun/channel/events.py: the rank->launcher event channel, one JSON line per event, whole under
concurrent writers."""

from __future__ import annotations

import os
import threading

from zerorun.channel import events


def test_events_over_a_pipe() -> None:
    r, w = os.pipe()
    try:
        assert events.connect(w)
        events.emit("status", step=3, loss=1.5, obj=object())
        big = "x" * 100_000  # longer than PIPE_BUF, still one line
        threads = [threading.Thread(target=events.emit, args=("status",), kwargs={"blob": big}) for _ in range(3)]
        reader_out: list[bytes] = []
        reader = threading.Thread(target=lambda: reader_out.append(_read_all(r)))
        reader.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        events.disconnect()
        os.close(w)
        w = -1
        reader.join(10)
        lines = reader_out[0].splitlines()
        first = events.decode_line(lines[0])
        assert first["kind"] == "status" and first["step"] == 3 and first["pid"] == os.getpid()
        assert first["obj"].startswith("<object object")
        assert [len(events.decode_line(ln)["blob"]) for ln in lines[1:]] == [100_000] * 3
        assert events.decode_line(b"not json") is None and events.decode_line(b"[1]") is None
    finally:
        events.disconnect()
        os.close(r)
        if w >= 0:
            os.close(w)
    events.emit("status", step=1)  # disconnected: a no-op, no error


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)
