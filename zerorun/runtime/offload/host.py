"""Host buffers and device<->host copies for offload.

``Copier`` hides the difference between a CUDA training device and the CPU one the tests use.

On CUDA it owns two side streams, one per direction (PCIe is full duplex: gradients going down
and parameters going up overlap). Every copy is ordered after a *ready* event recorded on the
training loop's stream (so it reads finished gradients / never races a kernel still using its
destination) and records a ``done`` event; the training loop's stream waits on those events
(``fence``) before touching the memory again -- an event wait on the GPU, not a host sync. Host
code that needs the data (the CPU optimizer step) calls ``event.synchronize()`` tile by tile.
Streams and the current device are per thread in PyTorch, so the ready event is taken on the
training loop's thread and passed along; a worker thread never asks for "the current stream".

On the CPU every copy is synchronous and events are ``None``.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable

import torch

from zerorun.runtime.observe.timers import Mark, Stamp

__all__ = ["Copier", "host_empty", "registered_empty", "mapped_empty", "huge_pages", "tiles", "EXACT_PIN_MIN_BYTES"]


# Page-locked buffers at least this large are allocated at their exact size (below). PyTorch's
# pinned allocator (`pin_memory=True`) rounds every request up to a power of two -- a 0.8 GB
# master shard takes 1 GiB, ~1.3x the model states on the host (the largest model one machine
# trains is bounded by host memory) -- and caches freed blocks; small buffers keep using it.
EXACT_PIN_MIN_BYTES = 16 * 1024**2


class _RegisteredBuffer(mmap.mmap):
    """Anonymous memory of exactly the requested pages, page-locked with cudaHostRegister and
    unregistered before it is unmapped: the tensor made over it (`torch.frombuffer`) holds
    this object, so it lives exactly as long as the tensor's storage (views included)."""

    _unregister: Callable[[int], object] | None = None
    _ptr = 0

    def __del__(self) -> None:
        if self._unregister is not None and self._ptr:
            self._unregister(self._ptr)
            self._ptr = 0


def _cudart_register(ptr: int, nbytes: int) -> bool:
    # note: pins nbytes now (the pages are faulted in and locked, counted against ulimit -l)
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0


def _cudart_unregister(ptr: int, device: int | None = None) -> object:
    # The buffer may still be the source or destination of a copy queued on a side stream (the
    # last step's write-backs are fenced on the training stream only, never waited for on the
    # host): unpinning and unmapping the pages under a DMA in flight corrupts whatever reuses
    # them. Wait for the device first -- buffers are kept for the run, so this costs a sync at
    # teardown only.
    try:
        if not torch.cuda.is_current_stream_capturing():  # (a sync would invalidate a capture)
            torch.cuda.synchronize(device)
    except Exception:  # interpreter shutdown / no context: nothing left to wait for
        pass
    try:
        return torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: the CUDA runtime (or torch) is already gone
        return None


_HUGE = 2 * 1024**2  # a transparent huge page (x86-64, and arm64 with 4 KB base pages)


def huge_pages() -> bool:
    """Back the lasting host buffers with transparent huge pages (``ZERORUN_HUGEPAGES``, default
    on)? The CPU step streams master, gradient, m and v through memory, and with 4 KB pages each
    stream crosses a page (a TLB entry, a stop for the hardware prefetcher) every 4 KB. Where
    THP is ``madvise`` (the usual default) memory is huge only when asked for. Measured on the
    H200 host (benchmarks/host_pages_ab.py): no consistent difference, -6 % to +8 % against
    4 KB pages. On because the final offload rows were all measured with it; at most one
    partly used 2 MB page per buffer more of resident memory."""
    return os.environ.get("ZERORUN_HUGEPAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def mapped_empty(numel: int, dtype: torch.dtype, *, huge: bool) -> tuple[mmap.mmap, torch.Tensor]:
    """A 1-D tensor over fresh anonymous memory (zeros) of whole pages; with ``huge`` the mapping
    is 2 MB-aligned and advised MADV_HUGEPAGE before it is touched, so the kernel can back it
    with huge pages. The tensor holds the mapping (its storage's buffer)."""
    size = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
    size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    # Private: a bare mmap.mmap(-1, n) is MAP_SHARED, i.e. shmem, which THP leaves alone
    # (shmem_enabled, "never" by default).
    buf = _RegisteredBuffer(-1, size + (_HUGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = 0
    if huge:
        base = torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr()
        offset = -base % _HUGE
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP "never", or a kernel without it: 4 KB pages, nothing else changes
            pass
    t = torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset) if numel else torch.empty(0, dtype=dtype)
    return buf, t


def registered_empty(
    numel: int,
    dtype: torch.dtype,
    register: Callable[[int, int], bool] = _cudart_register,
    unregister: Callable[[int], object] = _cudart_unregister,
    *,
    huge: bool = False,
) -> torch.Tensor | None:
    """A 1-D host tensor of exactly ``numel`` elements (rounded up to whole pages) page-locked
    by ``register``; None when registering fails (the caller falls back)."""
    if not numel:
        return None
    buf, t = mapped_empty(numel, dtype, huge=huge)
    ptr = t.data_ptr()
    nbytes = -(-t.numel() * t.element_size() // mmap.PAGESIZE) * mmap.PAGESIZE
    if not register(ptr, nbytes):
        return None
    assert isinstance(buf, _RegisteredBuffer)
    buf._ptr, buf._unregister = ptr, unregister
    return t


def host_empty(numel: int, dtype: torch.dtype, *, pin: bool, lasting: bool = False) -> torch.Tensor:
    """A 1-D host tensor; page-locked when ``pin`` (only meaningful with a CUDA device: pinned
    memory makes copies truly asynchronous and about twice as fast, and counts against
    ``ulimit -l``). A ``lasting`` buffer (kept for the run: masters, gradients, staging,
    parameter shards) of EXACT_PIN_MIN_BYTES or more takes exactly its size; short-lived ones
    use PyTorch's caching pinned allocator (registering memory costs time on every allocation)."""
    large = lasting and numel * torch.empty((), dtype=dtype).element_size() >= EXACT_PIN_MIN_BYTES
    if pin and torch.cuda.is_available():
        if large:
            device = torch.cuda.current_device()  # the context the pages are registered in
            exact = registered_empty(
                numel, dtype, unregister=lambda ptr: _cudart_unregister(ptr, device), huge=huge_pages()
            )
            if exact is not None:
                return exact
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    if large and huge_pages():
        return mapped_empty(numel, dtype, huge=True)[1]
    return torch.empty(numel, dtype=dtype)


def tiles(numel: int, tile: int) -> list[tuple[int, int]]:
    return [(a, min(a + tile, numel)) for a in range(0, numel, tile)] or [(0, 0)]


class Copier:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._down: torch.cuda.Stream | None = None
        self._up: torch.cuda.Stream | None = None
        if self.cuda:
            self._down = torch.cuda.Stream(device)
            self._up = torch.cuda.Stream(device)
        self._lock = threading.Lock()
        # wall_clock_breakdown: (begin, end) marks of every copy, by direction ("d2h", "h2d"):
        # CUDA timing events on the copy stream (read at the print step), or perf_counter
        # seconds around the synchronous CPU copies. Off by default (timing events cost a little).
        self.timing = False
        self._marks: dict[str, list[Mark]] = {}

    def take_marks(self) -> dict[str, list[Mark]]:
        """The copies' marks since the last call (wall_clock_breakdown's offload sub-phases)."""
        with self._lock:
            marks, self._marks = self._marks, {}
        return marks

    def _begin(self, stream: torch.cuda.Stream | None) -> Stamp | None:
        if not self.timing:
            return None
        if stream is None:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def _end(self, direction: str, begin: Stamp | None, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """The copy's done mark (a CUDA event when ``stream``), kept with ``begin`` when timing."""
        if stream is None:
            if begin is not None:
                self._marks.setdefault(direction, []).append((begin, time.perf_counter()))
            return None
        done = torch.cuda.Event(enable_timing=begin is not None)
        done.record(stream)
        if begin is not None:
            self._marks.setdefault(direction, []).append((begin, done))
        return done

    # -- ordering with the training loop (call on its thread) --------------------------------
    def ready(self) -> torch.cuda.Event | None:
        """An event on the caller's current stream: later copies start after everything queued
        there so far."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def fence(self, event: torch.cuda.Event | None) -> None:
        """The caller's stream waits for ``event`` (a copy's completion): no host sync."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    # -- copies (any thread) -----------------------------------------------------------------
    def to_host(self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None) -> torch.cuda.Event | None:
        return self._copy(self._down, "d2h", dst, src, after)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None) -> torch.cuda.Event | None:
        return self._copy(self._up, "h2d", dst, src, after)

    def _copy(
        self,
        stream: torch.cuda.Stream | None,
        direction: str,
        dst: torch.Tensor,
        src: torch.Tensor,
        after: torch.cuda.Event | None,
    ) -> torch.cuda.Event | None:
        on_host = dst.device.type == "cpu" and src.device.type == "cpu"
        if stream is not None and on_host and dst.dtype != src.dtype:
            return self._cast_through_device(stream, direction, dst, src, after)
        if stream is None or on_host:
            with self._lock:
                begin = self._begin(None)
                with torch.no_grad():
                    dst.copy_(src)
                return self._end(direction, begin, None)
        with self._lock, torch.cuda.device(self.device), torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            begin = self._begin(stream)
            with torch.no_grad():
                if dst.dtype != src.dtype and dst.device.type == "cuda":
                    # Host -> device with a cast: move the bytes as they are, cast on the GPU (the
                    # CPU is the bottleneck of offload; PCIe has room). The temporary lives on
                    # this stream only.
                    tmp = torch.empty(src.shape, dtype=src.dtype, device=dst.device)
                    tmp.copy_(src, non_blocking=True)
                    dst.copy_(tmp)
                elif dst.dtype != src.dtype:
                    # Device -> host with a cast (a bf16 gradient, options.narrow_grads): cast on
                    # the GPU, move the narrow bytes.
                    dst.copy_(src.to(dst.dtype), non_blocking=True)
                else:
                    dst.copy_(src, non_blocking=True)
            done = self._end(direction, begin, stream)
        return done

    def _cast_through_device(
        self,
        stream: torch.cuda.Stream,
        direction: str,
        dst: torch.Tensor,
        src: torch.Tensor,
        after: torch.cuda.Event | None,
    ) -> torch.cuda.Event | None:
        """A host -> host copy with a cast (stage 3 parameter offload: the updated fp32 master
        into the 16-bit host parameter shard) done by the GPU on ``stream``: up as it is, cast
        there, down into ``dst``. The CPU -- the bottleneck of offload -- does no conversion pass
        (on the training thread it also ran beside the worker's step, two thread pools on the
        same cores); PCIe carries 4 + 2 bytes. Asynchronous when ``dst`` is pinned: whoever
        reads ``dst`` on the host or from another stream waits for the returned event first."""
        with self._lock, torch.cuda.device(self.device), torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            begin = self._begin(stream)
            with torch.no_grad():
                tmp = torch.empty(src.shape, dtype=src.dtype, device=self.device)
                tmp.copy_(src, non_blocking=True)
                dst.copy_(tmp.to(dst.dtype), non_blocking=True)
            return self._end(direction, begin, stream)

    def upload(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A new device tensor filled from host ``src`` on the H2D stream, and its done event.
        The memory is allocated on that stream, so the copy need not wait for the training
        stream's queued work (it starts at once: a prefetch really runs ahead); the caller fences
        the consumer stream and ``record_stream``s it there."""
        assert self._up is not None
        with self._lock, torch.cuda.device(self.device), torch.cuda.stream(self._up):
            out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            begin = self._begin(self._up)
            with torch.no_grad():
                out.copy_(src, non_blocking=True)
            done = self._end("h2d", begin, self._up)
        assert done is not None  # a CUDA stream always gives an event
        return out, done

    @staticmethod
    def wait(event: torch.cuda.Event | None) -> None:
        """Block this host thread until the copy finished (a host sync, by design: the CPU step
        needs the bytes)."""
        if event is not None:
            event.synchronize()
