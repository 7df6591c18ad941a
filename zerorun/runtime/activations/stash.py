"""Where a checkpointed input waits for its recomputation.

A checkpointed block's inputs are the only activations kept between its forward and its
backward. `Stash` holds one block's tensor inputs in one of three ways:

* on the device, as they are (plain checkpointing);
* `cpu_checkpointing`: in pinned host memory. The device-to-host copy runs on a side CUDA
  stream (ordered after the producer by an event; `record_stream` keeps the source block alive
  until the copy is done), so forward does not wait for it. In backward, restoring block k
  starts the host-to-device copy of the block before it (k-1, the next one backward needs) on
  the side stream: the GPU holds about one block's inputs beyond the one being recomputed.
* `partition_activations`: each rank of the model-parallel group keeps its 1/N slice (of the
  padded flat tensor; on the host too with `cpu_checkpointing`) and the recomputation
  all-gathers the whole. Correct only when the tensor is the same on every rank of the group --
  activations replicated by tensor parallelism -- which is the group an `mpu` names.

On a CPU device, host memory *is* the device: `cpu_checkpointing` keeps the tensor as is.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PartitionGroup", "Stash"]

# torch 2.13 renamed all_gather_into_tensor (the old name warns on every call); 2.11 has only it.
_all_gather_flat: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class PartitionGroup:
    """The ranks that hold identical activations (an mpu's model-parallel group)."""

    group: Any
    rank: int
    size: int


class _Side:
    """One side stream per device for the host copies."""

    streams: dict[torch.device, torch.cuda.Stream] = {}

    @classmethod
    def of(cls, device: torch.device) -> torch.cuda.Stream:
        if device not in cls.streams:
            cls.streams[device] = torch.cuda.Stream(device=device)
        return cls.streams[device]


# Stashes on the host, in forward order: backward restores them in reverse, and prefetches
# the one before. Weak references: a graph dropped without backward frees its stashes.
_host_order: list[weakref.ref[Stash]] = []


class _Held:
    """One tensor input as stored: `data` (device, host or a slice), how to rebuild it."""

    __slots__ = ("data", "shape", "dtype", "device", "numel", "partitioned", "ready", "prefetched")

    def __init__(self, data: torch.Tensor, shape: torch.Size, dtype: torch.dtype, device: torch.device, numel: int):
        self.data = data
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.numel = numel
        self.partitioned = False
        self.ready: torch.cuda.Event | None = None  # the D2H copy into `data` is done
        self.prefetched: tuple[torch.Tensor, torch.cuda.Event] | None = None


class Stash:
    def __init__(self, args: tuple[Any, ...], *, cpu: bool, partition: PartitionGroup | None) -> None:
        self._items: list[Any] = []
        self._on_host = False
        for arg in args:
            if not torch.is_tensor(arg):
                self._items.append(arg)
                continue
            x = arg.detach()
            part = partition if partition is not None and partition.size > 1 and x.is_floating_point() else None
            held = _Held(x, x.shape, x.dtype, x.device, x.numel())
            if part is not None:
                flat = x.reshape(-1)
                per = -(-flat.numel() // part.size)
                piece = flat[part.rank * per : (part.rank + 1) * per]
                # A slice of our own: the full tensor must not stay alive through a view of it.
                held.data = torch.zeros(per, dtype=x.dtype, device=x.device)
                held.data[: piece.numel()].copy_(piece)
                held.partitioned = True
            if cpu and x.device.type == "cuda":
                held.data, held.ready = self._to_host(held.data)
                self._on_host = True
            self._items.append(held)
        if self._on_host:
            _host_order.append(weakref.ref(self))

    @staticmethod
    def _to_host(src: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        side = _Side.of(src.device)
        side.wait_stream(torch.cuda.current_stream(src.device))
        host = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=True)
        with torch.cuda.stream(side):
            host.copy_(src, non_blocking=True)
            src.record_stream(side)  # the allocator keeps src until the copy ran
            done = torch.cuda.Event()
            done.record(side)
        return host, done

    def prefetch(self) -> None:
        """Start copying this block's host tensors back to the device on the side stream."""
        for held in self._items:
            if not isinstance(held, _Held) or held.prefetched is not None or held.data.device.type != "cpu":
                continue
            if held.device.type != "cuda":
                continue
            side = _Side.of(held.device)
            side.wait_stream(torch.cuda.current_stream(held.device))
            with torch.cuda.stream(side):
                if held.ready is not None:
                    side.wait_event(held.ready)
                dev = held.data.to(held.device, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            held.prefetched = (dev, done)

    def restore(self, partition: PartitionGroup | None) -> list[Any]:
        """The inputs again, on their device (waits for a prefetch, all-gathers a partition);
        then starts prefetching the block before this one."""
        if self._on_host:
            self._forget()
            self.prefetch()
        out: list[Any] = []
        for held in self._items:
            if not isinstance(held, _Held):
                out.append(held)
                continue
            data = held.data
            if held.prefetched is not None:
                dev, done = held.prefetched
                stream = torch.cuda.current_stream(held.device)
                stream.wait_event(done)
                dev.record_stream(stream)
                data = dev
            if held.partitioned:
                assert partition is not None
                full = torch.empty(data.numel() * partition.size, dtype=held.dtype, device=held.device)
                _all_gather_flat(full, data, group=partition.group)
                data = full[: held.numel].view(held.shape)
            out.append(data)
        self._items = []
        self._prefetch_previous()
        return out

    def _forget(self) -> None:
        for i in range(len(_host_order) - 1, -1, -1):
            if _host_order[i]() is self:
                del _host_order[i]
                return

    def _prefetch_previous(self) -> None:
        while _host_order:
            prev = _host_order[-1]()
            if prev is None:
                _host_order.pop()
                continue
            prev.prefetch()
            return
