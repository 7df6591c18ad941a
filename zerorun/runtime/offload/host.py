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

import threading

import torch

__all__ = ["Copier", "host_empty", "tiles"]


def host_empty(numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """A 1-D host tensor; page-locked when ``pin`` (only meaningful with a CUDA device: pinned
    memory makes copies truly asynchronous and about twice as fast, and counts against
    ``ulimit -l``)."""
    if pin and torch.cuda.is_available():
        return torch.empty(numel, dtype=dtype, pin_memory=True)
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
        return self._copy(self._down, dst, src, after)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None) -> torch.cuda.Event | None:
        return self._copy(self._up, dst, src, after)

    def _copy(
        self,
        stream: torch.cuda.Stream | None,
        dst: torch.Tensor,
        src: torch.Tensor,
        after: torch.cuda.Event | None,
    ) -> torch.cuda.Event | None:
        if stream is None or (dst.device.type == "cpu" and src.device.type == "cpu"):
            with torch.no_grad():
                dst.copy_(src)
            return None
        with self._lock, torch.cuda.device(self.device), torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            with torch.no_grad():
                if dst.dtype != src.dtype and dst.device.type == "cuda":
                    # Host -> device with a cast: move the bytes as they are, cast on the GPU (the
                    # CPU is the bottleneck of offload; PCIe has room). The temporary lives on
                    # this stream only.
                    tmp = torch.empty(src.shape, dtype=src.dtype, device=dst.device)
                    tmp.copy_(src, non_blocking=True)
                    dst.copy_(tmp)
                else:
                    dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def upload(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A new device tensor filled from host ``src`` on the H2D stream, and its done event.
        The memory is allocated on that stream, so the copy need not wait for the training
        stream's queued work (it starts at once: a prefetch really runs ahead); the caller fences
        the consumer stream and ``record_stream``s it there."""
        assert self._up is not None
        with self._lock, torch.cuda.device(self.device), torch.cuda.stream(self._up):
            out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            with torch.no_grad():
                out.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._up)
        return out, done

    @staticmethod
    def wait(event: torch.cuda.Event | None) -> None:
        """Block this host thread until the copy finished (a host sync, by design: the CPU step
        needs the bytes)."""
        if event is not None:
            event.synchronize()
