"""Twin-Flow partial offload (``offload_optimizer.ratio``, DeepSpeed's ZeRO-Offload++): part of
each rank's fp32 masters and optimizer states stays on the training device and steps there,
concurrently with the CPU's step of the rest. Exact math: every element is updated by the same
Adam(W) formula, only the device doing it differs.

How zerorun splits (the unit is one flat buffer's shard, whole; DeepSpeed splits stage 3's
``sub_group_size`` groups instead, so the same value can give a different split):

* ``ratio`` r: the device keeps at most (1 - r) of this rank's shard elements -- the host's
  share is never below r, so the GPU never holds more than the ratio promises.
* ``ratio: "auto"`` (a zerorun extension): the device keeps at most
  ``zerorun.offload_gpu_budget_gb`` worth of masters + optimizer states
  (``estimate.offload_budget_numel``: budget / (4 + state bytes) elements; fp32 training 0 + state
  bytes, the parameter shard being the master).
* Which buffers: from the last flat buffer backwards, each buffer that still fits the limit.
  Flat buffers are in gradient order, so the last ones are reduced last in the backward: their
  CPU step could not have overlapped the backward anyway, while the first ones' CPU steps start
  during the backward (no clipping / no fp16) and run while the GPU finishes it.

The device part steps on the training thread (CUDA: kernels on the training stream, queued
after the host part was handed to the worker thread, so both run at once).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["device_buffers"]


def device_buffers(numels: Sequence[int], ratio: float | None, budget_numel: int) -> list[bool]:
    """Which flat buffers' masters stay on the device: ``ratio`` is the host's share (None:
    ``"auto"``, the device holds at most ``budget_numel`` elements)."""
    total = sum(numels)
    if ratio is None:
        limit = budget_numel
    else:
        # The host share is at least `ratio` (a float product rounded down for the device).
        limit = int((1.0 - ratio) * total + 1e-9) if ratio < 1.0 else 0
    out = [False] * len(numels)
    used = 0
    for i in range(len(numels) - 1, -1, -1):
        if numels[i] > 0 and used + numels[i] <= limit:
            out[i] = True
            used += numels[i]
    return out
