"""`zerorun plot RUN_DIR -o FILE.png`: loss, learning rate, throughput and memory of a run as
one PNG. `runs.py` reads a run (stdlib only); `figure.py` draws it with matplotlib, an optional
extra (`pip install 'zerorun[plot]'`) imported only when a figure is drawn."""

from __future__ import annotations

from zerorun.plot.runs import RunSeries, read_run

__all__ = ["RunSeries", "read_run"]
