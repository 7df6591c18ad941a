"""``offload_optimizer: {device: cpu}``: fp32 masters and optimizer states in host memory.

The pipeline (gradient copies, tiled CPU step, parameter copies, delayed update) is
``pipeline.HostPlacement``; this class says the storage is ordinary host memory. The masters are
page-locked with ``pin_memory`` because the updated parameters are copied up straight from them
(fp32) and cast on the GPU: no host staging buffer, no CPU conversion pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from zerorun.runtime.offload.host import host_empty
from zerorun.runtime.offload.host_placement import HostPlacement, StepJob, TileView

__all__ = ["CpuPlacement"]


class CpuPlacement(HostPlacement):
    name = "cpu"
    stage_on_host = False  # parameters go up from the (pinned) masters, cast on the GPU
    partial_ok = True  # Twin-Flow (offload_optimizer.ratio < 1)

    def _new_master(self, index: int, numel: int, fp32_init: Callable[[], torch.Tensor]) -> torch.Tensor:
        master = host_empty(numel, torch.float32, pin=self.pin, lasting=True)
        with torch.no_grad():
            master.copy_(fp32_init())
        return master

    def _state_tensor(self, index: int, key: str) -> torch.Tensor:
        # m and v: lasting, never copied (not pinned), streamed by every step (huge pages)
        return host_empty(self.masters[index].numel(), torch.float32, pin=False, lasting=True).zero_()

    def _tile_views(self, job: StepJob, indices: list[int]) -> Iterator[TileView]:
        for i in indices:
            master = self.masters[i]
            state = job.states[i] or {}
            for k, (a, b) in enumerate(self.tiles[i]):
                vmax = state.get("max_exp_avg_sq")
                yield TileView(
                    i,
                    k,
                    a,
                    b,
                    master[a:b],
                    state["exp_avg"][a:b] if state else master[a:b],
                    state["exp_avg_sq"][a:b] if state else master[a:b],
                    vmax[a:b] if vmax is not None else None,
                )
