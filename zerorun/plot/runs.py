"""What a run left on disk -> the series a plot needs. Standard library only.

Two kinds of run directory are understood:

* the launcher's `--log_dir` (`events.jsonl`): rank 0's `status` events (loss, lr, samples/s,
  tokens/s by optimizer step; runtime/observe/report.py), every rank's `memory` events (GPU
  allocated or host RSS over time, and the runtime's per-component breakdown), every rank's
  wall-clock breakdown (`timers_ms`) at its last report. With `--max_restarts` each attempt has
  its own `attemptN/events.jsonl` (launch/restart.py): they are read in order as one run (a
  resumed attempt's steps replace the same steps of the one before);
* a `csv_monitor` directory (`output_path` or `output_path/job_name`): DeepSpeed's
  `Train_Samples_*.csv` files, x = samples seen.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerorun.errors import ZerorunError

__all__ = ["RunSeries", "read_run"]


@dataclass
class RunSeries:
    source: str  # "log_dir" | "csv_monitor"
    x_label: str  # "optimizer step" | "samples"
    loss: list[tuple[float, float]] = field(default_factory=list)
    lr: list[tuple[float, float]] = field(default_factory=list)
    throughput: list[tuple[float, float]] = field(default_factory=list)
    throughput_label: str = "tokens/s"
    memory: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # rank -> (seconds, bytes)
    memory_label: str = "GPU allocated"
    breakdown: dict[int, dict[str, float]] = field(default_factory=dict)  # rank -> component -> bytes
    timers: dict[int, dict[str, float]] = field(default_factory=dict)  # rank -> phase -> ms


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _flat_breakdown(b: dict[str, Any]) -> dict[str, float]:
    """{device: {component: bytes}} or {component: bytes} -> {component: bytes} (summed over devices)."""
    out: dict[str, float] = {}
    for key, value in b.items():
        if isinstance(value, dict):
            for comp, n in value.items():
                if _num(n) and comp != "total":
                    out[comp] = out.get(comp, 0.0) + float(n)
        elif _num(value) and key != "total":
            out[key] = out.get(key, 0.0) + float(value)
    return out


def _lines(paths: list[Path]) -> Iterator[str]:
    for path in paths:
        yield from path.read_text(encoding="utf-8", errors="replace").splitlines()


def _attempts(d: Path) -> list[Path]:
    """`attemptN/events.jsonl` of a log dir written with --max_restarts, in attempt order."""
    found = [(int(p.parent.name[7:]), p) for p in d.glob("attempt*/events.jsonl") if p.parent.name[7:].isdigit()]
    return [p for _, p in sorted(found)]


def _from_events(paths: list[Path]) -> RunSeries:
    run = RunSeries(source="log_dir", x_label="optimizer step")
    loss: dict[float, float] = {}
    lr: dict[float, float] = {}
    tokens: dict[float, float] = {}
    samples: dict[float, float] = {}
    gpu: dict[int, list[tuple[float, float]]] = {}
    rss: dict[int, list[tuple[float, float]]] = {}
    t0: float | None = None
    for line in _lines(paths):
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if not isinstance(ev, dict):
            continue
        rank, kind, t = ev.get("rank"), ev.get("kind"), ev.get("t")
        if _num(t):
            t0 = t if t0 is None else min(t0, t)
        if kind == "status" and _num(ev.get("step")):
            if isinstance(ev.get("timers_ms"), dict) and isinstance(rank, int):
                run.timers[rank] = {k: float(v) for k, v in ev["timers_ms"].items() if _num(v)}
            if rank != 0:
                continue
            step = float(ev["step"])
            if _num(ev.get("loss")):
                loss[step] = float(ev["loss"])
            if _num(ev.get("lr")):
                lr[step] = float(ev["lr"])
            if _num(ev.get("tokens_per_sec")):
                tokens[step] = float(ev["tokens_per_sec"])
            if _num(ev.get("samples_per_sec")):
                samples[step] = float(ev["samples_per_sec"])
        elif kind == "memory" and isinstance(rank, int) and _num(t):
            g = ev.get("gpu")
            if isinstance(g, dict) and _num(g.get("allocated")):
                gpu.setdefault(rank, []).append((float(t), float(g["allocated"])))
            if _num(ev.get("rss")):
                rss.setdefault(rank, []).append((float(t), float(ev["rss"])))
            if isinstance(ev.get("breakdown"), dict):
                run.breakdown[rank] = _flat_breakdown(ev["breakdown"])
    run.loss, run.lr = sorted(loss.items()), sorted(lr.items())
    if tokens:
        run.throughput = sorted(tokens.items())
    else:
        run.throughput, run.throughput_label = sorted(samples.items()), "samples/s"
    memory, run.memory_label = (gpu, "GPU allocated") if gpu else (rss, "host RSS")
    base = t0 or 0.0
    run.memory = {r: [(t - base, v) for t, v in pts] for r, pts in sorted(memory.items())}
    return run


def _read_csv(path: Path) -> list[tuple[float, float]]:
    rows = list(csv.reader(path.open(encoding="utf-8")))
    out = []
    for row in rows[1:]:
        try:
            out.append((float(row[0]), float(row[1])))
        except (ValueError, IndexError):
            continue
    return out


def _from_csv(directory: Path) -> RunSeries:
    run = RunSeries(source="csv_monitor", x_label="samples")
    files = {p.stem: p for p in directory.glob("Train_Samples_*.csv")}
    if "Train_Samples_train_loss" in files:
        run.loss = _read_csv(files["Train_Samples_train_loss"])
    if "Train_Samples_lr" in files:
        run.lr = _read_csv(files["Train_Samples_lr"])
    if "Train_Samples_tokens_per_sec" in files:
        run.throughput = _read_csv(files["Train_Samples_tokens_per_sec"])
    elif "Train_Samples_samples_per_sec" in files:
        run.throughput, run.throughput_label = _read_csv(files["Train_Samples_samples_per_sec"]), "samples/s"
    if "Train_Samples_gpu_memory_allocated" in files:
        run.memory = {0: _read_csv(files["Train_Samples_gpu_memory_allocated"])}
    return run


def read_run(path: str | Path) -> RunSeries:
    """RUN_DIR (a launcher log_dir, a csv_monitor directory or its parent) -> RunSeries."""
    d = Path(path)
    if not d.is_dir():
        raise ZerorunError(f"{d}: no such directory (give the launcher's --log_dir or a csv_monitor output path)")
    if (d / "events.jsonl").is_file():
        return _from_events([d / "events.jsonl"])
    if _attempts(d):
        return _from_events(_attempts(d))
    if any(d.glob("Train_Samples_*.csv")):
        return _from_csv(d)
    subdirs = [s for s in sorted(d.iterdir()) if s.is_dir() and any(s.glob("Train_Samples_*.csv"))]
    if len(subdirs) == 1:
        return _from_csv(subdirs[0])
    if len(subdirs) > 1:
        names = ", ".join(s.name for s in subdirs)
        raise ZerorunError(f"{d} holds several csv_monitor jobs ({names}): give one of them")
    raise ZerorunError(
        f"{d} has neither events.jsonl (a launcher --log_dir) nor Train_Samples_*.csv files (a csv_monitor "
        "output_path/job_name)"
    )
