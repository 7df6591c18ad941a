"""Which cores zerorun's CPU kernel pins its pool to (runtime/offload/cpu_kernel.pool_cores):
never the ones the caller and the training thread run on, never cores another rank shares."""

from __future__ import annotations

import os
import threading

import pytest

from zerorun.runtime.offload import cpu_kernel

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity")


def test_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZERORUN_CPU_PIN", raising=False)
    assert cpu_kernel.pool_cores(1) is None


def test_the_last_cores_and_none_when_nothing_is_left(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZERORUN_CPU_PIN", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one core")
    assert cpu_kernel.pool_cores(len(allowed) - 1) == allowed[1:]
    assert cpu_kernel.pool_cores(len(allowed)) is None  # the caller would share a pinned core


def test_ranks_sharing_the_node_s_cores_are_not_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZERORUN_CPU_PIN", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    if len(os.sched_getaffinity(0)) < (os.cpu_count() or 0):
        pytest.skip("this process already has an affinity of its own")
    assert cpu_kernel.pool_cores(1) is None


def test_a_pinned_pool_thread_runs_on_its_core(monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one core")
    seen: list[set[int]] = []

    def pool_thread() -> None:
        cpu_kernel._pin_thread(iter([allowed[-1]]), threading.Lock())
        seen.append(os.sched_getaffinity(0))

    t = threading.Thread(target=pool_thread)
    t.start()
    t.join()
    assert seen == [{allowed[-1]}] and sorted(os.sched_getaffinity(0)) == allowed  # the caller is untouched
