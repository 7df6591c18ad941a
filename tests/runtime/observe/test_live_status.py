"""The light `status` event between print steps (report.py `_light_status`): it carries the loss
for the live panel, and on CUDA reads it without a host sync (a pinned copy read at the next light
status, so the loss is the previous light status's). Real event channel: a pipe."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from zerorun.channel import events
from zerorun.runtime.observe import FlopsProfilerOptions, ObserveOptions, StepReporter


@contextmanager
def _no_host_sync(device: str) -> Iterator[None]:
    if device != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _statuses(device: str, losses: list[float], monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    r, w = os.pipe()
    monkeypatch.setattr(events, "_fd", w)
    monkeypatch.setattr(events, "_resolved", True)
    no_profile = FlopsProfilerOptions(False, 1, -1, 1, False, None, 0.0)
    reporter = StepReporter(
        ObserveOptions(10**9, False, (), no_profile), rank=0, world_size=1, device=torch.device(device), fp16=False
    )
    values = [torch.tensor(loss, device=device) for loss in losses]
    if device == "cuda":
        torch.cuda.synchronize()
    for step, loss in enumerate(values, start=1):
        with _no_host_sync(device):  # on CUDA, a synchronizing call (loss.item()) raises here
            reporter.on_backward(loss)
            reporter._last_light = -1.0  # a second has passed since the last light status
            reporter.after_step(step=step, samples=step, skipped=0, lrs=[0.1], moms=[], loss_scale=1.0, grad_norm=None)
        if device == "cuda":
            torch.cuda.synchronize()  # the test's own wait: the copy is complete at the next status
    os.close(w)
    with os.fdopen(r) as f:
        return [e for e in map(json.loads, f.read().splitlines()) if e["kind"] == "status"]


def test_cpu_status_carries_the_steps_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    got = _statuses("cpu", [3.5, 2.25, 1.125], monkeypatch)
    assert [(e["step"], e["loss"], e["lr"]) for e in got] == [(1, 3.5, 0.1), (2, 2.25, 0.1), (3, 1.125, 0.1)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_checks.sh)")
def test_cuda_status_reads_the_loss_without_a_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    got = _statuses("cuda", [3.5, 2.25, 1.125], monkeypatch)
    # each status carries the loss copied at the previous one
    assert [(e["step"], e["loss"]) for e in got] == [(1, None), (2, 3.5), (3, 2.25)]
