"""``offload_param`` (stage 3): the at-rest parameter shards on the host (Contract 6's
``ParamShardStore`` seam, ``runtime/stage3/param_store.py``).

* ``cpu``: each shard is a host tensor (page-locked with ``pin_memory``). ``fetch`` -- called
  when stage 3 issues the group's all-gather, i.e. ahead of use when the group is prefetched --
  starts the host->device copy on a side stream at once (into memory allocated on that stream,
  so it does not wait for the compute queued before it) and orders the training stream after it
  (event wait, no host sync), so the copy is prefetched with the gather.
* ``nvme``: each shard is a file under ``nvme_path`` mapped into memory; ``fetch`` reads it
  through the page cache into a (pinned) host buffer, then copies it up as above.

The optimizer's write-back lands directly in the host shard (``ShardPlacement.write_back`` is
given it as ``dst``). With CPU optimizer offload and a step started during the backward, that
write-back may still be pending when the step returns (``HostPlacement.settle``): the placement
sets ``before_read``, and ``fetch`` -- or ``settle``, for stage 3's host readers (model_io) --
completes it for the shard first, so the next forward starts while the CPU steps later shards.
On a CPU training device (tests) ``fetch`` returns the shard itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from zerorun.runtime.memory import MemoryLedger
from zerorun.runtime.offload.host import Copier, host_empty
from zerorun.runtime.offload.options import OffloadOptions
from zerorun.runtime.sharded_state import DevicePlacement, ParamShardStore

__all__ = ["HostParamStore", "DeviceWithParamStore", "param_store_for"]


class HostParamStore(ParamShardStore):
    """A ``ParamShardStore`` (the stage-3 parameter placement seam, sharded_state.py) on the host."""

    resident = False

    def __init__(self, opts: OffloadOptions, device: torch.device) -> None:
        self.device = device
        self.pin = opts.param_pin_memory and device.type == "cuda"
        self.copier = Copier(device)
        self._shards: dict[int, torch.Tensor] = {}
        self._files = None
        if opts.param_device == "nvme":
            from zerorun.runtime.offload.nvme import TileFiles

            assert opts.param_nvme_path is not None
            self._files = TileFiles(opts.param_nvme_path, int(os.environ.get("RANK", "0") or 0))
        self.fetches = 0  # host->device copies issued (tests check the store is used)
        # Set by the optimizer placement: completes a shard's pending write-back (key) before
        # it is read. None: nothing is ever pending.
        self.before_read: Callable[[int], None] | None = None

    def settle(self, key: int) -> None:
        """Shard ``key`` holds the latest update (a pending write-back completed)."""
        if self.before_read is not None:
            self.before_read(key)

    def allocate(self, key: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self._files is not None:
            shard = self._files.create_typed(f"param{key}", numel, dtype)
        else:
            shard = host_empty(numel, dtype, pin=self.pin, lasting=True)
            shard.zero_()
        self._shards[key] = shard
        return shard

    def fetch(self, key: int, shard: torch.Tensor) -> torch.Tensor:
        self.settle(key)
        self.fetches += 1
        if self.device.type != "cuda":
            return shard
        src = shard
        if self._files is not None:
            src = host_empty(shard.numel(), shard.dtype, pin=self.pin)
            src.copy_(shard)  # file pages -> pinned buffer (host thread; page cache)
        out, done = self.copier.upload(src)
        self.copier.fence(done)
        # Allocated on the copy stream, used on the training stream (and the gather's stream,
        # which stage 3 orders back into it before release): keep the block until that work is
        # done. (The one record_stream in offload: the buffer changes streams by design.)
        out.record_stream(torch.cuda.current_stream(self.device))
        return out

    def release(self, key: int, fetched: torch.Tensor) -> None:
        return None  # the device copy is dropped; the allocator reuses it in stream order

    def tensors(self) -> list[torch.Tensor]:
        return [] if self._files is not None else list(self._shards.values())

    def add_memory(self, ledger: MemoryLedger) -> None:
        """File-backed shards are on NVMe, not in memory (stage 3 reports them as params)."""
        if self._files is None:
            return
        shards = list(self._shards.values())
        ledger.exclude(shards)
        ledger.add_bytes("params", "nvme", sum(t.numel() * t.element_size() for t in shards))

    def close(self) -> None:
        if self._files is not None:
            self._files.close()


def param_store_for(opts: OffloadOptions, device: torch.device) -> HostParamStore:
    return HostParamStore(opts, device)


class DeviceWithParamStore(DevicePlacement):
    """Optimizer on the device, parameters offloaded: the default placement plus the store."""

    def __init__(self, device: torch.device, store: HostParamStore) -> None:
        super().__init__(device)
        self.param_store = store
        self._store = store

    def make_master(
        self, index: int, param_shard: torch.Tensor, fp32_init: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        # The at-rest shard is on the host now: even in fp32 training it cannot double as the
        # master the device optimizer steps, so the master is a device copy.
        if param_shard.device == self.device:
            return super().make_master(index, param_shard, fp32_init)
        return fp32_init().to(self.device, torch.float32, copy=True)

    def add_memory(self, ledger: MemoryLedger) -> None:
        self._store.add_memory(ledger)

    def close(self) -> None:
        self._store.close()
