"""Exact accounting of the bytes the runtime holds, per component and device.

Counts tensors the runtime owns (each storage once, so a master that is a view of an fp32
parameter shard counts only as a parameter). Categories (Contract 4 in docs/architecture.md):

    params            16-bit (or fp32) parameters, trainable and frozen
    grads             gradient memory kept between backward and step
    master            fp32 master copies (absent in fp32 training)
    optimizer_states  the optimizer's per-element state tensors
    buffers           communication buffers: the peak bytes of staging buckets seen so far
    module_buffers    the model's registered buffers (running stats, ...)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["CATEGORIES", "MemoryLedger", "storage_bytes"]

CATEGORIES = ("params", "grads", "master", "optimizer_states", "buffers", "module_buffers")


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class MemoryLedger:
    """Accumulates tensors by category; a storage already counted is not counted again."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()
        self.by_device: dict[str, dict[str, int]] = {}

    def add(self, category: str, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            key = _storage_key(t)
            if key in self._seen or key[1] == 0:
                continue
            self._seen.add(key)
            self.add_bytes(category, str(t.device), storage_bytes(t))

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Storages accounted elsewhere (e.g. files mapped into memory, counted as ``nvme``
        bytes by the offload placement): later ``add`` calls skip them."""
        for t in tensors:
            if t is not None and t.device.type != "meta":
                self._seen.add(_storage_key(t))

    def add_bytes(self, category: str, device: str, nbytes: int) -> None:
        dev = self.by_device.setdefault(device, {c: 0 for c in CATEGORIES})
        dev[category] = dev.get(category, 0) + int(nbytes)

    def summary(self) -> dict[str, dict[str, int]]:
        out = {d: dict(c) for d, c in self.by_device.items()}
        for c in out.values():
            c["total"] = sum(v for k, v in c.items() if k != "total")
        return out
