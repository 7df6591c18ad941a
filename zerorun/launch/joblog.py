"""A job's files under `--log_dir`: `rank<N>.log` (every line a rank printed), `events.jsonl`
(every Contract 3 event, tagged with its rank) and `summary.json` (the `JobResult`).

Owned by the supervisor and used only from its main thread, so no locks.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

from zerorun.launch import fdlimit
from zerorun.launch.result import JobResult

__all__ = ["JobLog"]


class JobLog:
    """Open with `open()`, write while the job runs, `close()` once with the result.

    A rank's file is opened at its first line (every rank's exists after `close`): opening
    8,000 files costs seconds on some file systems (~0.5 ms each measured on the CI machine),
    which would otherwise delay every node's start. Only files written since the last `flush`
    are flushed."""

    def __init__(self, log_dir: Path, run_id: str) -> None:
        self.log_dir = log_dir
        self.run_id = run_id
        self._ranks: dict[int, TextIO | None] = {}
        self._dirty: set[int] = set()
        self._events: TextIO | None = None

    def open(self, ranks: Iterable[int]) -> None:
        ranks = list(ranks)
        fdlimit.check(len(ranks) + 1, f"the {len(ranks)} log files under --log_dir")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._ranks = dict.fromkeys(ranks)
        self._events = open(self.log_dir / "events.jsonl", "w", encoding="utf-8")  # noqa: SIM115

    def _file(self, rank: int) -> TextIO:
        # Buffered, flushed after every batch of messages (`flush`): a write per line would
        # cost more than the console itself.
        f = open(self.log_dir / f"rank{rank}.log", "w", encoding="utf-8")  # noqa: SIM115
        self._ranks[rank] = f
        return f

    def output(self, rank: int, text: str) -> None:
        if rank not in self._ranks:
            return
        log = self._ranks[rank] or self._file(rank)
        log.write(text + "\n")
        self._dirty.add(rank)

    def event(self, rank: int, event: Mapping[str, Any]) -> None:
        if self._events is not None:
            self._events.write(json.dumps({"rank": rank, **event}, default=str) + "\n")

    def flush(self) -> None:
        for rank in self._dirty:
            f = self._ranks.get(rank)
            if f is not None:
                f.flush()
        self._dirty.clear()
        if self._events is not None:
            self._events.flush()

    def close(self, result: JobResult) -> None:
        for rank, f in self._ranks.items():
            (f or self._file(rank)).close()  # a rank that printed nothing: an empty file
        if self._events is not None:
            self._events.close()
        data = {"run_id": self.run_id, **result.to_json()}
        (self.log_dir / "summary.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
