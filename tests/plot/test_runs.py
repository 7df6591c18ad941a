"""zerorun plot's reading of a run directory (plot/runs.py), on files written here."""

from __future__ import annotations

import json
from pathlib import Path

from zerorun.plot import read_run


def _events(path: Path, events: list[dict]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_a_log_dir_with_restarts_is_read_as_one_run(tmp_path: Path) -> None:
    # --max_restarts with --log_dir: attempt k's events are in attemptk/ (launch/restart.py).
    # Attempt 1 reached step 3 and died; attempt 2 resumed from step 2's checkpoint.
    _events(tmp_path / "attempt1", [
        {"kind": "status", "rank": 0, "t": 100.0, "step": s, "loss": 10.0 - s, "lr": 0.1} for s in (1, 2, 3)
    ] + [{"kind": "memory", "rank": 1, "t": 101.0, "rss": 5.0}])
    _events(tmp_path / "attempt2", [
        {"kind": "status", "rank": 0, "t": 200.0, "step": s, "loss": 20.0 - s, "lr": 0.1} for s in (3, 4)
    ] + [{"kind": "memory", "rank": 1, "t": 201.0, "rss": 6.0}])
    (tmp_path / "attempt10").mkdir()  # not an attempt with events: ignored
    run = read_run(tmp_path)
    assert run.loss == [(1.0, 9.0), (2.0, 8.0), (3.0, 17.0), (4.0, 16.0)]
    assert run.memory == {1: [(1.0, 5.0), (101.0, 6.0)]}  # seconds since the run's first event
