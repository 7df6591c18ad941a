"""wall_clock_breakdown's offload sub-phases (observe/timers.py OFFLOAD_PHASES; issue 18): the
gradient copies down, the CPU step, the parameter copies up and the waits are measured where they
happen (runtime/offload) and shown beside fwd/bwd/step -- one real rank per configuration on the
device zerorun picks (_breakdown_worker.py); PhaseTimers' sources directly."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from zerorun.runtime.observe.timers import OFFLOAD_PHASES, PHASES, PhaseTimers

from ._spawn import results_per_world

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return results_per_world(tmp_path_factory, HERE / "_breakdown_worker.py", prefix="breakdown", deadline_s=180)(1)


def test_a_source_adds_its_phases_to_each_step_and_only_then() -> None:
    timers = PhaseTimers(torch.device("cpu"))
    assert [*timers.collect()] == []
    with timers.phase("step"):
        time.sleep(0.002)
    timers.end_step()
    plain = timers.collect()
    assert list(plain[0]) == list(PHASES) and plain[0]["step"] >= 2.0  # no offload columns
    t0 = time.perf_counter()
    steps = iter([{"offload_cpu_step": 7.5, "offload_d2h": [(t0, t0 + 0.004)]}, {}])
    timers.sources.append(lambda: next(steps))
    timers.end_step()
    timers.end_step()
    rows = timers.collect()
    assert list(rows[0]) == [*PHASES, "offload_d2h", "offload_cpu_step"]
    assert rows[0]["offload_cpu_step"] == 7.5 and rows[0]["offload_d2h"] == pytest.approx(4.0)
    assert rows[1]["offload_cpu_step"] == 0.0  # a step without them: 0, same columns


@pytest.mark.parametrize("case", ["z2-offload", "z2-offload-clip", "z3-param-offload"])
def test_offload_sub_phases_are_in_the_breakdown(results: dict, case: str) -> None:
    r = results[case]
    timers, prof = r["timers"], r["profile"]
    for name in ("offload_d2h", "offload_cpu_step", "offload_h2d", "offload_grad_wait", "offload_step_wait"):
        assert name in timers and f"{name}: " in r["line"], (case, r)
    # The CPU step did work and moved bytes both ways; its time is the worker's own clock.
    assert timers["offload_cpu_step"] > 0 and timers["offload_d2h"] > 0 and timers["offload_h2d"] > 0
    # What the training thread waited for lies inside the step phase that contains it (on the
    # CPU both are host clocks; on CUDA `step` is the stream's events, which may start late).
    if r["device"] == "cpu":
        assert timers["offload_step_wait"] <= timers["step"] + 1e-6
    # The last step's sub-phases are the placement's own profile (ms vs s).
    assert set(prof) >= {"adam_s", "main_wait_s"}
    if case == "z3-param-offload":
        assert "offload_param_fetch" in timers


def test_no_offload_no_offload_columns(results: dict) -> None:
    r = results["z2-none"]
    assert not set(OFFLOAD_PHASES) & set(r["timers"]) and "offload" not in r["line"]
    assert r["timers"]["step"] > 0
