"""A job's files under `--log_dir`: `rank<N>.log` (every line a rank printed), `events.jsonl`
(every Contract 3 event, tagged with its rank) and `summary.json` (the `JobResult`; after a
run that raised before it had one, `reason: "not_started"` and the error).

The supervisor calls it from its main thread; the disk work happens on a writer thread of its
own, so a slow file system never holds up the event loop (fail-fast, heartbeats, the console).
Measured on the CI machine: opening a file ~0.5-2.5 ms, a small write+flush ~40 us -- at
8,000 ranks, seconds of blocking per step if done inline. A rank's file is opened at its first
line (every rank's exists after `close`); lines reach the disk within ~1 s (each written file
is flushed at most once a second) and all of them at `close`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from zerorun.launch import fdlimit
from zerorun.launch.result import JobResult, RankState

__all__ = ["JobLog"]

_EVENT = -1  # the pending list's rank for an events.jsonl record
_RUNS = -2  # ... for a batch of runs of rank lines
_WRITE_EVERY_S = 0.1  # lines reach the disk at most this late (and at close)
_WAKE_AT = 20_000  # pending lines that wake the writer at once
_FLUSH_EVERY_S = 1.0  # written files are flushed at most this often (and at close)


class JobLog:
    """Open with `open()`, write while the job runs, `close()` once with the result."""

    def __init__(self, log_dir: Path, run_id: str) -> None:
        self.log_dir = log_dir
        self.run_id = run_id
        self._files: dict[int, TextIO | None] = {}
        self._events: TextIO | None = None
        # (rank, line), (_RUNS, [run, ...]) or (_EVENT, (rank, event)); and how many lines
        self._pending: list[tuple[int, Any]] = []
        self._pending_lines = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._writer: threading.Thread | None = None
        self.error: OSError | None = None  # the first write error (disk full): logging stops
        self._dirty: set[int] = set()  # written since the last flush (writer thread only)
        self._flushed_at = 0.0

    def open(self, ranks: Iterable[int]) -> None:
        ranks = list(ranks)
        fdlimit.check(len(ranks) + 1, f"the {len(ranks)} log files under --log_dir")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._files = dict.fromkeys(ranks)
        self._events = open(self.log_dir / "events.jsonl", "w", encoding="utf-8")  # noqa: SIM115
        self._writer = threading.Thread(target=self._write_loop, name="zerorun-joblog", daemon=True)
        self._writer.start()

    def output(self, rank: int, text: str) -> None:
        if rank in self._files:
            with self._lock:
                self._pending.append((rank, text))
                self._pending_lines += 1

    def runs(self, runs: Sequence[Any], lines: int) -> None:
        """A batch's runs of rank lines (`RankLines`/`RankOutput`: `.rank`, `.lines`), `lines`
        lines in all: one hand-over per batch; the writer thread writes each run with one join."""
        if runs and self._files:
            with self._lock:
                self._pending.append((_RUNS, runs))
                self._pending_lines += lines

    def event(self, rank: int, event: Mapping[str, Any]) -> None:
        if self._events is not None:
            with self._lock:
                self._pending.append((_EVENT, (rank, event)))
                self._pending_lines += 1

    def flush(self) -> None:
        """Called after each batch. The writer drains every `_WRITE_EVERY_S` by itself; it is
        woken early only for a large backlog (waking it per batch cost more than the writes)."""
        if self._pending_lines > _WAKE_AT:
            self._wake.set()

    def close(self, result: JobResult) -> None:
        self._finish({"run_id": self.run_id, **result.to_json()})

    def abort(self, error: str, ranks: Iterable[RankState]) -> None:
        """Close after a run that raised instead of producing a result (a runner's start()
        failed): the lines already received are written, every file closed, and summary.json
        says what happened and what each rank got to."""
        self._finish(
            {"run_id": self.run_id, "exit_code": None, "reason": "not_started", "message": error,
             "ranks": [r.to_json() for r in ranks]}
        )  # fmt: skip

    def _finish(self, data: dict[str, Any]) -> None:
        self._stop = True
        self._wake.set()
        if self._writer is not None:
            self._writer.join()
        self._drain()
        for rank, f in self._files.items():
            try:
                (f or self._file(rank)).close()  # a rank that printed nothing: an empty file
            except OSError:
                pass
        if self._events is not None:
            self._events.close()
        if self.error is not None:
            data["log_error"] = f"writing the logs stopped: {self.error}"
        (self.log_dir / "summary.json").write_text(json.dumps(data, indent=2, default=str) + "\n")

    # -- the writer thread ------------------------------------------------------------------

    def _file(self, rank: int) -> TextIO:
        # Buffered; flushed once per batch: a write per line would cost more than the lines.
        f = open(self.log_dir / f"rank{rank}.log", "w", encoding="utf-8")  # noqa: SIM115
        self._files[rank] = f
        return f

    def _write_loop(self) -> None:
        while not self._stop:
            self._wake.wait(_WRITE_EVERY_S)
            self._wake.clear()
            self._drain()

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._pending_lines = 0
        if not pending or self.error is not None:
            return
        dirty = self._dirty
        try:
            for rank, item in pending:
                if rank == _EVENT:
                    r, ev = item
                    if self._events is not None:
                        self._events.write(json.dumps({"rank": r, **ev}, default=str) + "\n")
                    continue
                if rank == _RUNS:
                    files = self._files
                    for run in item:
                        r = run.rank
                        if r in files and run.lines:
                            (files[r] or self._file(r)).write("\n".join(run.lines) + "\n")
                            dirty.add(r)
                    continue
                (self._files[rank] or self._file(rank)).write(item + "\n")
                dirty.add(rank)
            now = time.monotonic()
            if now - self._flushed_at >= _FLUSH_EVERY_S or self._stop:
                # One write() per written file: at most once a second (per drain, 512 files
                # cost ~11 us of launcher CPU per line here).
                self._flushed_at = now
                for rank in dirty:
                    f = self._files.get(rank)
                    if f is not None:
                        f.flush()
                dirty.clear()
                if self._events is not None:
                    self._events.flush()
        except OSError as err:
            self.error = err
