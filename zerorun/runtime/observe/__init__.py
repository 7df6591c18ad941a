"""Seeing what training does: progress reports (`steps_per_print`), the wall-clock breakdown
(`wall_clock_breakdown`), monitors (`tensorboard`, `wandb`, `csv_monitor`, `comet`) and the
FLOPs profiler (`flops_profiler`). docs/observability.md.

The engine owns one `StepReporter` and calls it at four points (forward, backward, the phases
of a step, after each optimizer step); nothing else in the runtime knows about this package.
"""

from __future__ import annotations

from zerorun.runtime.observe.monitors import MonitorSet
from zerorun.runtime.observe.options import FlopsProfilerOptions, MonitorOptions, ObserveOptions
from zerorun.runtime.observe.report import StepReporter, count_tokens
from zerorun.runtime.observe.timers import PHASES, PhaseTimers

__all__ = [
    "PHASES",
    "FlopsProfilerOptions",
    "MonitorOptions",
    "MonitorSet",
    "ObserveOptions",
    "PhaseTimers",
    "StepReporter",
    "count_tokens",
]
