"""Monitors: rank 0 writes training scalars to TensorBoard, Weights & Biases, CSV files or Comet.

Events are DeepSpeed's `(tag, value, global_samples)` triples with DeepSpeed's tag names
(`Train/Samples/train_loss`, `Train/Samples/lr`, `Train/Samples/loss_scale`,
`Train/Samples/elapsed_time_ms_forward`, ...), so dashboards built for DeepSpeed keep working;
zerorun adds `Train/Samples/grad_norm`, `Train/Samples/samples_per_sec`,
`Train/Samples/tokens_per_sec` and, on CUDA, `Train/Samples/gpu_memory_allocated` /
`Train/Samples/gpu_memory_max_allocated` (bytes). The x-axis is the number of samples seen, as
in DeepSpeed.

Layouts follow DeepSpeed: tensorboard and csv_monitor write under `output_path/job_name`
(csv: one `<tag with / -> _>.csv` per tag with a `step,<last tag part>` header); wandb logs
`{tag: value}` at `step=samples` in project/team(entity)/group; comet logs each tag at most once
per `samples_log_interval` samples. A backend's package is imported only when its monitor is
enabled; the config check (zerorun.config) already refused an enabled monitor whose package
is missing, before any rank started.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from typing import Any, Protocol

from zerorun.config.observe_sections import MONITOR_EXTRAS
from zerorun.errors import RuntimeConfigError
from zerorun.runtime.observe.options import MonitorOptions

__all__ = ["Event", "Monitor", "MonitorSet", "CsvMonitor", "TensorboardMonitor", "WandbMonitor", "CometMonitor"]

Event = tuple[str, float, int]  # (tag, value, global samples)


class Monitor(Protocol):
    def write_events(self, events: Sequence[Event]) -> None: ...
    def close(self) -> None: ...


def _log_dir(opts: MonitorOptions) -> str:
    path = os.path.join(opts.output_path or "", opts.job_name)
    os.makedirs(path, exist_ok=True)
    return path


class CsvMonitor:
    def __init__(self, opts: MonitorOptions) -> None:
        self.log_dir = _log_dir(opts)
        self._started: set[str] = set()

    def write_events(self, events: Sequence[Event]) -> None:
        rows: dict[str, list[tuple[int, float]]] = {}
        for tag, value, step in events:
            rows.setdefault(tag, []).append((step, value))
        for tag, values in rows.items():
            name = tag.replace("/", "_").replace(" ", "_")
            path = os.path.join(self.log_dir, name + ".csv")
            # A restarted job appends to the same file, as DeepSpeed's does; the header is
            # written once per file.
            fresh = name not in self._started and not os.path.exists(path)
            self._started.add(name)
            with open(path, "a", newline="", encoding="utf-8") as f:
                writer = csv.writer(f)
                if fresh:
                    writer.writerow(["step", tag.rsplit("/", 1)[-1]])
                writer.writerows(values)

    def close(self) -> None:
        pass


class TensorboardMonitor:
    def __init__(self, opts: MonitorOptions) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = _log_dir(opts)
        self._writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: Sequence[Event]) -> None:
        for tag, value, step in events:
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbMonitor:
    def __init__(self, opts: MonitorOptions) -> None:
        import wandb

        self._wandb = wandb
        p = opts.params
        # WANDB_MODE=offline (or `wandb offline`) keeps everything local, as with DeepSpeed.
        self._run = wandb.init(project=p.get("project") or "deepspeed", entity=p.get("team"), group=p.get("group"))

    def write_events(self, events: Sequence[Event]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for tag, value, step in events:
            by_step.setdefault(step, {})[tag] = value
        for step in sorted(by_step):
            self._run.log(by_step[step], step=step)

    def close(self) -> None:
        self._run.finish()


class CometMonitor:
    def __init__(self, opts: MonitorOptions) -> None:
        import comet_ml

        p = opts.params
        kwargs = {k: p.get(k) for k in ("api_key", "project", "workspace", "experiment_key", "mode", "online")}
        self._experiment = comet_ml.start(**{k: v for k, v in kwargs.items() if v is not None})
        if p.get("experiment_name"):
            self._experiment.set_name(p["experiment_name"])
        self._interval = int(p.get("samples_log_interval") or 100)
        self._last: dict[str, int] = {}

    def write_events(self, events: Sequence[Event]) -> None:
        for tag, value, step in events:
            last = self._last.get(tag)
            if last is None or step - last >= self._interval:
                self._last[tag] = step
                self._experiment.log_metric(tag, value, step=step)

    def close(self) -> None:
        self._experiment.end()


_BACKENDS: dict[str, Any] = {
    "csv_monitor": CsvMonitor,
    "tensorboard": TensorboardMonitor,
    "wandb": WandbMonitor,
    "comet": CometMonitor,
}


class MonitorSet:
    """The enabled monitors of this rank (none except on rank 0)."""

    def __init__(self, options: Sequence[MonitorOptions], *, rank: int) -> None:
        self.monitors: list[Monitor] = []
        if rank != 0:
            return
        for opts in options:
            try:
                self.monitors.append(_BACKENDS[opts.backend](opts))
            except ImportError as exc:
                # The config check ran where the config was loaded; this rank's node may lack it.
                package = MONITOR_EXTRAS.get(opts.backend, (opts.backend, opts.backend))[1]
                raise RuntimeConfigError(
                    f"{opts.backend}.enabled is true but its package cannot be imported on this node ({exc}): "
                    f"pip install {package} (or `pip install 'zerorun[{opts.backend}]'`), "
                    f"or set {opts.backend}.enabled: false"
                ) from None

    @property
    def enabled(self) -> bool:
        return bool(self.monitors)

    def write_events(self, events: Sequence[Event]) -> None:
        for monitor in self.monitors:
            monitor.write_events(events)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
        self.monitors = []
