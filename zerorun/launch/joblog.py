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
    """Open with `open()`, write while the job runs, `close()` once with the result."""

    def __init__(self, log_dir: Path, run_id: str) -> None:
        self.log_dir = log_dir
        self.run_id = run_id
        self._ranks: dict[int, TextIO] = {}
        self._events: TextIO | None = None

    def open(self, ranks: Iterable[int]) -> None:
        ranks = list(ranks)
        fdlimit.check(len(ranks) + 1, f"the {len(ranks)} log files under --log_dir")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for rank in ranks:
            # Buffered, flushed after every batch of messages (`flush`): a write per line
            # would cost more than the console itself.
            self._ranks[rank] = open(self.log_dir / f"rank{rank}.log", "w", encoding="utf-8")  # noqa: SIM115
        self._events = open(self.log_dir / "events.jsonl", "w", encoding="utf-8")  # noqa: SIM115

    def output(self, rank: int, text: str) -> None:
        log = self._ranks.get(rank)
        if log is not None:
            log.write(text + "\n")

    def event(self, rank: int, event: Mapping[str, Any]) -> None:
        if self._events is not None:
            self._events.write(json.dumps({"rank": rank, **event}, default=str) + "\n")

    def flush(self) -> None:
        for f in self._ranks.values():
            f.flush()
        if self._events is not None:
            self._events.flush()

    def close(self, result: JobResult) -> None:
        for f in self._ranks.values():
            f.close()
        if self._events is not None:
            self._events.close()
        data = {"run_id": self.run_id, **result.to_json()}
        (self.log_dir / "summary.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
