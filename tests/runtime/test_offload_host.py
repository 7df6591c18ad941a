"""Exact-size page-locked host buffers (runtime/offload/host.py): PyTorch's pinned allocator
rounds to powers of two, so large offload buffers are registered at their own size instead."""

from __future__ import annotations

import gc
import mmap
import os

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


def _vma_of(ptr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding ``ptr``."""
    fields: dict[str, str] = {}
    inside = False
    for line in open("/proc/self/smaps").read().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
            if inside:
                fields["perms"] = line.split()[1]
        elif inside and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux /proc")
@pytest.mark.parametrize("huge", [False, True])
def test_mapped_buffers_are_private_zeroed_and_huge_when_asked(huge: bool) -> None:
    n = (4 << 20) + 5  # 16 MB and a little: several huge pages, not a whole number of them
    buf, t = host.mapped_empty(n, torch.float32, huge=huge)
    assert t.numel() == n and not t.any()
    t.fill_(1.0)
    vma = _vma_of(t.data_ptr())
    # MAP_PRIVATE: a shared anonymous mapping (mmap.mmap's default) is shmem, never THP-backed
    assert vma["perms"].endswith("p")
    if huge:
        assert t.data_ptr() % (2 << 20) == 0
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
        if "[never]" not in thp:
            assert vma["THPeligible"] == "1"
    del t, buf
    gc.collect()


def test_huge_pages_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZERORUN_HUGEPAGES", "0")
    assert not host.huge_pages()
    monkeypatch.setenv("ZERORUN_HUGEPAGES", "1")
    assert host.huge_pages() == hasattr(mmap, "MADV_HUGEPAGE")


def test_registered_huge_buffer_registers_the_aligned_pages() -> None:
    log: list[tuple[int, int]] = []
    t = host.registered_empty(
        (2 << 20) // 4 + 1, torch.float32, lambda p, n: log.append((p, n)) or True, lambda p: None, huge=True
    )
    assert t is not None and log == [(t.data_ptr(), (2 << 20) + 4096)] and t.data_ptr() % (2 << 20) == 0
