"""Where a partitioned group's at-rest parameter shard lives (Contract 6, "stage 3 parameter
placement"). The only seam parameter offload plugs into: stage 3 never branches on offload.

A store hands out the at-rest shard of each flat buffer (``allocate``), and brings it to the
training device when the group's all-gather is issued (``fetch``) -- which happens ahead of use
when the group is prefetched, so a host-to-device copy started there is prefetched with it.
"""

from __future__ import annotations

import torch

from zerorun.runtime.memory import MemoryLedger

__all__ = ["ParamShardStore", "DeviceParamStore"]


class ParamShardStore:
    """Base class; see docs/architecture.md (Contract 6) for the contract."""

    #: True when ``fetch`` returns the at-rest shard itself (it lives on the training device).
    #: With one rank such a shard *is* the whole flat buffer, so stage 3 binds the parameters to
    #: it for good and never gathers or releases (no copy at all).
    resident: bool = False

    def allocate(self, key: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def fetch(self, key: int, shard: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def release(self, key: int, fetched: torch.Tensor) -> None:
        return None

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def add_memory(self, ledger: MemoryLedger) -> None:
        """Bytes held beyond ``tensors()`` (host buffers, files), for ``engine.memory_summary``."""
        return None

    def close(self) -> None:
        """Release what the store holds (``engine.destroy``)."""
        return None


class DeviceParamStore(ParamShardStore):
    """At-rest shards on the training device; fetching is free."""

    resident = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._shards: dict[int, torch.Tensor] = {}

    def allocate(self, key: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        shard = torch.zeros(numel, dtype=dtype, device=self.device)
        self._shards[key] = shard
        return shard

    def fetch(self, key: int, shard: torch.Tensor) -> torch.Tensor:
        return shard

    def tensors(self) -> list[torch.Tensor]:
        return list(self._shards.values())
