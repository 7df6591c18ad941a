"""Draw a RunSeries as one PNG (matplotlib, imported here only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zerorun.errors import ZerorunError
from zerorun.plot.runs import RunSeries

__all__ = ["render"]


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ZerorunError(
            "zerorun plot needs matplotlib: pip install matplotlib (or pip install 'zerorun[plot]')"
        ) from None
    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt


def _line(ax: Any, points: list[tuple[float, float]], title: str, xlabel: str, **kw: Any) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    if points:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="." if len(points) < 50 else None, **kw)
    else:
        ax.text(0.5, 0.5, "not in this run", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.grid(alpha=0.3)


def render(run: RunSeries, out: str | Path, *, title: str | None = None) -> Path:
    plt = _matplotlib()
    fig, axes = plt.subplots(3, 2, figsize=(12, 12))
    (a_loss, a_lr), (a_tp, a_mem), (a_bd, a_tm) = axes
    _line(a_loss, run.loss, "loss", run.x_label)
    _line(a_lr, run.lr, "learning rate", run.x_label)
    _line(a_tp, run.throughput, run.throughput_label, run.x_label)
    a_mem.set_title(f"{run.memory_label} per rank (GiB)")
    a_mem.set_xlabel("seconds" if run.source == "log_dir" else run.x_label)
    for rank, pts in run.memory.items():
        if pts:
            xs, ys = zip(*pts, strict=True)
            a_mem.plot(xs, [y / 2**30 for y in ys], label=f"rank {rank}")
    if run.memory:
        a_mem.legend(fontsize="small")
    else:
        a_mem.text(0.5, 0.5, "not in this run", ha="center", va="center", transform=a_mem.transAxes, color="grey")
    a_mem.grid(alpha=0.3)
    biggest = max((sum(d.values()) for d in run.breakdown.values()), default=0.0)
    unit, scale = ("GiB", 2**30) if biggest >= 2**30 else ("MiB", 2**20)
    _stacked(a_bd, run.breakdown, f"memory by component per rank ({unit}, last report)", scale=scale)
    _stacked(a_tm, run.timers, "wall-clock breakdown per rank (ms per step, last report)", scale=1.0, keys=("fwd", "bwd", "step"))
    fig.suptitle(title or f"zerorun run ({run.source})")
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _stacked(ax: Any, data: dict[int, dict[str, float]], title: str, *, scale: float, keys: tuple[str, ...] | None = None) -> None:
    ax.set_title(title)
    if not data:
        ax.text(0.5, 0.5, "not in this run", ha="center", va="center", transform=ax.transAxes, color="grey")
        return
    ranks = sorted(data)
    names = list(keys) if keys else sorted({k for d in data.values() for k in d})
    bottom = [0.0] * len(ranks)
    for name in names:
        values = [data[r].get(name, 0.0) / scale for r in ranks]
        ax.bar([str(r) for r in ranks], values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xlabel("rank")
    ax.legend(fontsize="small")
