"""Result records: one JSON file per configuration run, written as soon as it finishes.

A record is a flat-ish dict (schema `SCHEMA`); `report.py` turns a directory of them into
RESULTS.md. Files are written atomically (temp file + rename), so a run cut short leaves only
whole records. A bundle (one JSON record per line, appended and fsynced per record) carries a
whole run back from a machine that returns only a few files; `import_bundle` splits it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["SCHEMA", "record_filename", "write_record", "load_records", "import_bundle"]

SCHEMA = "zerorun-bench/1"


def record_filename(record: dict[str, Any]) -> str:
    """`<run_id>__<label>.json`; label = config, `-2` for a repeat, `mem-` prefix in memory mode."""
    label = str(record["config"])
    if record.get("mode") == "memory":
        label = f"mem-{label}"
    if int(record.get("repeat", 1)) > 1:
        label = f"{label}-{record['repeat']}"
    return f"{record['run_id']}__{label}.json"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_record(out_dir: Path, record: dict[str, Any], bundle: Path | None = None) -> Path:
    """Write `record` under `out_dir` (and append it to `bundle`); returns the file's path."""
    record = {"schema": SCHEMA, **record}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / record_filename(record)
    _atomic_write(path, json.dumps(record, indent=1, sort_keys=True) + "\n")
    if bundle is not None:
        bundle.parent.mkdir(parents=True, exist_ok=True)
        with open(bundle, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
    return path


def load_records(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Records from files and directories (their *.json), skipping files of another schema."""
    records = []
    for p in paths:
        files = sorted(p.glob("*.json")) if p.is_dir() else [p]
        for f in files:
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as e:
                # Other tools write beside us (launch-overhead results); never let one file
                # stop the table.
                print(f"skipping {f}: not a readable JSON record ({e})", file=sys.stderr)
                continue
            if isinstance(data, dict) and data.get("schema") == SCHEMA:
                records.append(data)
    return records


def import_bundle(bundle: Path, out_dir: Path) -> list[Path]:
    """Split a bundle (JSON lines) into record files under `out_dir`. A torn last line (the
    run was killed mid-write) is skipped."""
    written = []
    for line in bundle.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("schema") == SCHEMA:
            written.append(write_record(out_dir, record))
    return written
