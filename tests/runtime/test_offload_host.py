"""Exact-size page-locked host buffers (runtime/offload/host.py): PyTorch's pinned allocator
rounds to powers of two, so large offload buffers are registered at their own size instead."""

from __future__ import annotations

import gc

import pytest
import torch

from zerorun.runtime.offload import host


def test_registered_buffer_is_exact_and_unregistered_when_the_last_view_dies() -> None:
    log: list[tuple] = []

    def register(ptr: int, n: int) -> bool:
        log.append(("register", ptr, n))
        return True

    t = host.registered_empty(3 * 1024 + 1, torch.bfloat16, register, lambda p: log.append(("unregister", p)))
    assert t is not None and t.shape == (3073,) and t.dtype == torch.bfloat16
    # 6,146 bytes -> two whole pages, not the 8 KiB power of two (nor 1 GiB for a 0.8 GB shard)
    assert log == [("register", t.data_ptr(), 2 * 4096)]
    t.fill_(1.5)
    view = t[100:200]
    del t
    gc.collect()
    assert len(log) == 1 and float(view.float().sum()) == 150.0  # the storage lives on in the view
    del view
    gc.collect()
    assert log[-1][0] == "unregister" and log[-1][1] == log[0][1]


def test_a_failed_registration_returns_none_and_nothing_to_unregister() -> None:
    calls: list[int] = []
    assert host.registered_empty(4096, torch.float32, lambda p, n: False, calls.append) is None
    gc.collect()
    assert calls == []


def test_host_empty_on_a_cpu_only_machine_is_plain_memory() -> None:
    t = host.host_empty(host.EXACT_PIN_MIN_BYTES, torch.float32, pin=True, lasting=True)
    assert t.numel() == host.EXACT_PIN_MIN_BYTES and (torch.cuda.is_available() or not t.is_pinned())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_checks.sh)")
def test_exact_pinned_buffer_on_cuda_copies_asynchronously() -> None:
    n = host.EXACT_PIN_MIN_BYTES // 4 + 3
    t = host.host_empty(n, torch.float32, pin=True, lasting=True)
    assert t.numel() == n and t.is_pinned()
    t.copy_(torch.arange(n, dtype=torch.float32))
    d = torch.empty(n, device="cuda")
    d.copy_(t, non_blocking=True)
    back = host.host_empty(n, torch.float32, pin=True, lasting=True)
    back.copy_(d, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, t)
    del t, back
    gc.collect()
    # The two buffers were unregistered as they died (the CPU test above checks the calls): a
    # fresh one, likely at a reused range, registers again instead of failing as already registered.
    again = host.host_empty(n, torch.float32, pin=True, lasting=True)
    assert again.is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_checks.sh)")
def test_registered_buffer_waits_for_a_copy_in_flight_before_it_is_unpinned() -> None:
    # A side-stream copy into the buffer is still queued (behind a sleep) when the last
    # reference dies: unregistering and unmapping must wait for it, not pull the pages from
    # under the DMA (the last step's write-backs are only fenced on the GPU).
    n = host.EXACT_PIN_MIN_BYTES // 4
    t = host.host_empty(n, torch.float32, pin=True, lasting=True)
    src = torch.ones(n, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU cycles
        t.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    del t
    gc.collect()
    assert done.query()  # the copy had landed before the pages were unpinned
