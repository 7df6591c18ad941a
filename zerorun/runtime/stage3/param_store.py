"""Where a partitioned group's at-rest parameter shard lives (Contract 6, "stage 3 parameter
placement"). The only seam parameter offload plugs into: stage 3 never branches on offload.

A store hands out the at-rest shard of each flat buffer (``allocate``), and brings it to the
training device when the group's all-gather is issued (``fetch``) -- which happens ahead of use
when the group is prefetched, so a host-to-device copy started there is prefetched with it.
"""

from __future__ import annotations

import torch

from zerorun.runtime.sharded_state import ParamShardStore

__all__ = ["ParamShardStore", "DeviceParamStore"]  # the base lives beside ShardPlacement


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
