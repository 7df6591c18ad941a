"""Pieces of runtime/observe that need no ranks: timers, token counting, the CSV layout, a
monitor whose package is missing on a rank."""

from __future__ import annotations

import csv
import io
import sys
import time
from pathlib import Path

import pytest
import torch

from zerorun.errors import RuntimeConfigError
from zerorun.runtime.observe import (
    FlopsProfilerOptions,
    MonitorOptions,
    ObserveOptions,
    PhaseTimers,
    StepReporter,
    count_tokens,
)
from zerorun.runtime.observe import report as report_module
from zerorun.runtime.observe.monitors import CsvMonitor, MonitorSet


def test_cpu_timers_sum_each_phase_per_step() -> None:
    t = PhaseTimers(torch.device("cpu"))
    for _ in range(2):  # two micro-steps in one optimizer step
        with t.phase("fwd"):
            time.sleep(0.01)
    t.end_step()
    with t.phase("step"):
        time.sleep(0.02)
    t.end_step()
    steps = t.collect()
    assert len(steps) == 2 and t.collect() == []
    assert 19 <= steps[0]["fwd"] < 60 and steps[0]["step"] == 0
    assert 19 <= steps[1]["step"] < 60 and steps[1]["fwd"] == 0


def test_count_tokens() -> None:
    ids = torch.zeros(4, 16, dtype=torch.long)
    assert count_tokens((ids,), {}) == 64
    assert count_tokens((), {"input_ids": ids}) == 64
    assert count_tokens(({"input_ids": ids},), {}) == 64
    assert count_tokens((torch.zeros(4, 16),), {}) == 0  # features, not token ids
    assert count_tokens((torch.zeros(4, dtype=torch.long),), {}) == 0  # labels of a 1-D batch


def test_csv_monitor_layout(tmp_path: Path) -> None:
    opts = MonitorOptions(backend="csv_monitor", output_path=str(tmp_path), job_name="run", params={})
    m = CsvMonitor(opts)
    m.write_events([("Train/Samples/train_loss", 2.5, 8), ("Train/Samples/lr", 0.1, 8)])
    m.write_events([("Train/Samples/train_loss", 2.25, 16)])
    text = (tmp_path / "run" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert text == ["step,train_loss", "8,2.5", "16,2.25"]
    # a second monitor (a restarted job) appends without a second header
    CsvMonitor(opts).write_events([("Train/Samples/train_loss", 2.0, 24)])
    assert (tmp_path / "run" / "Train_Samples_train_loss.csv").read_text().splitlines()[-2:] == ["16,2.25", "24,2.0"]


def test_monitor_package_missing_on_a_rank_names_the_pip_package(monkeypatch: pytest.MonkeyPatch) -> None:
    # The config check ran where the config was loaded; a rank on another node may still lack it.
    monkeypatch.setitem(sys.modules, "comet_ml", None)  # `import comet_ml` raises ImportError
    opts = MonitorOptions(backend="comet", output_path="", job_name="j", params={})
    with pytest.raises(RuntimeConfigError, match=r"pip install comet-ml .*comet.enabled: false"):
        MonitorSet([opts], rank=0)
    assert MonitorSet([opts], rank=1).enabled is False  # only rank 0 writes


def test_a_long_print_interval_holds_few_steps_and_the_monitors_get_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # steps_per_print 1e9 (DeepSpeed configs silence the prints so): the device values of at
    # most MAX_PENDING steps wait for a read; every step still reaches the monitors, nothing is printed.
    monkeypatch.setattr(report_module, "MAX_PENDING", 3)
    csv_opts = MonitorOptions(backend="csv_monitor", output_path=str(tmp_path), job_name="j", params={})
    no_profile = FlopsProfilerOptions(False, 1, -1, 1, False, None, 0.0)
    options = ObserveOptions(10**9, True, (csv_opts,), no_profile)
    out = io.StringIO()
    reporter = StepReporter(options, rank=0, world_size=1, device=torch.device("cpu"), fp16=False, stdout=out)
    losses = [float(i) + 0.5 for i in range(1, 8)]
    for step, loss in enumerate(losses, start=1):
        with reporter.phase("fwd"):
            pass
        reporter.on_backward(torch.tensor(loss))
        reporter.after_step(step=step, samples=4 * step, skipped=0, lrs=[0.1], moms=[], loss_scale=1.0,
                            grad_norm=torch.tensor(2.0))
        assert len(reporter._records) < 3 and reporter.timers is not None and reporter.timers.pending_steps() < 3
    reporter.close()
    assert out.getvalue() == ""
    rows = list(csv.reader((tmp_path / "j" / "Train_Samples_train_loss.csv").open()))
    assert rows[1:] == [[str(4 * i), str(loss)] for i, loss in enumerate(losses, start=1)]
    assert len(list(csv.reader((tmp_path / "j" / "Train_Samples_elapsed_time_ms_forward.csv").open()))) == 1 + 7
