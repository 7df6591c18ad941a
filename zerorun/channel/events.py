"""Rank -> launcher events: one JSON object per line on a pipe of its own (Contract 3).

Stdlib only: the shim and the runtime import this in every rank. Events never share stdout
with the user's prints, where threads and native writes would split or interleave them.
The launcher (or a node's agent) gives each rank the write end of a pipe and its number in
`ZERORUN_EVENT_FD`; outside the launcher there is no channel and `emit` does nothing.

Wire format: `{"kind": KIND, "t": unix_time, "pid": PID, ...payload}\\n`, UTF-8. One line is
written with a single `os.write` under a lock, so lines from several threads never mix (a
pipe write is atomic up to PIPE_BUF = 4096 bytes on Linux; longer lines are still whole
because the lock serialises writers within the process and only this process writes).

Kinds the launcher understands (others are logged to the events file and otherwise ignored):
- `memory`: `rss`, `rss_peak` (bytes, host), optional `gpu` {`allocated`, `reserved`,
  `peak`} (bytes, current device), optional `breakdown` (the runtime's per-component bytes,
  see `set_memory_provider`), `final` (True for the snapshot taken at exit).
- `status`: free-form training progress, by convention `step`, `loss`, `lr`.
- `error`: `type`, `message`, `traceback` of the exception that ended the rank.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "ENV_VAR",
    "emit",
    "connect",
    "connected",
    "disconnect",
    "set_memory_provider",
    "memory_provider",
    "decode_line",
]

ENV_VAR = "ZERORUN_EVENT_FD"

_lock = threading.Lock()
_fd: int | None = None
_resolved = False  # the environment has been looked at (connect() or the first emit)
_provider: Callable[[], Mapping[str, Any]] | None = None


def _after_fork_in_child() -> None:
    # A fork while another thread (the shim's memory reporter) held the lock would leave the
    # child's copy locked forever; a DataLoader worker that emits must not hang.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def connect(fd: int | None = None) -> bool:
    """Use `fd` (default: `$ZERORUN_EVENT_FD`) as the event channel; True when connected.

    The descriptor is made close-on-exec so programs the rank runs do not inherit it (a
    forked-but-not-exec'd child such as a DataLoader worker still shares it, harmlessly).
    """
    global _fd, _resolved
    with _lock:
        _resolved = True
        if fd is None:
            text = os.environ.get(ENV_VAR)
            if not text:
                return False
            try:
                fd = int(text)
            except ValueError:
                return False
        try:
            os.set_inheritable(fd, False)
            os.fstat(fd)
        except OSError:
            return False
        _fd = fd
        return True


def connected() -> bool:
    if not _resolved:
        connect()
    return _fd is not None


def disconnect() -> None:
    global _fd, _resolved
    with _lock:
        _fd = None
        _resolved = True


def emit(kind: str, **payload: Any) -> None:
    """Send one event to the launcher; a no-op when the rank was not started by it.

    Never raises: a launcher that has gone away (broken pipe) only disconnects the channel.
    Values that JSON cannot encode are sent as their `str()`.
    """
    global _fd
    if not connected():
        return
    record = {"kind": kind, "t": time.time(), "pid": os.getpid(), **payload}
    data = (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode("utf-8")
    with _lock:
        fd = _fd
        if fd is None:
            return
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
        except OSError:
            _fd = None


def set_memory_provider(fn: Callable[[], Mapping[str, Any]] | None) -> None:
    """Register the runtime's per-component memory accounting (bytes by component, optionally
    nested by device). The shim's periodic `memory` event includes what it returns."""
    global _provider
    _provider = fn


def memory_provider() -> Callable[[], Mapping[str, Any]] | None:
    return _provider


def decode_line(line: bytes | str) -> dict[str, Any] | None:
    """Launcher side: one line of the channel -> event dict, None if it is not one of ours."""
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return None
    return record
