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
* Which buffers: those whose gradients are final last in the backward, each that still fits
  the limit: their CPU step could not have overlapped the backward anyway, while the CPU steps of
  the buffers reduced first start during the backward (no clipping / no fp16) and run while the
  GPU finishes it. Stages 1-2: flat buffers are in gradient order, so from the last one
  backwards. Stage 3: flat buffers follow the module groups in forward order (the root group --
  embeddings, head -- first; it is reduced at the end of the backward), so from the first one
  forwards (``ready_order``). Taking stage 3's last buffers instead left the host the first
  layers, whose gradients come last: on one H200 (1.3B, ratio 0.5) the CPU waited 0.14 s for
  its first gradient instead of 0.07 s and stage 3 ran at 0.70x of no offload against stage 2's
  0.87x.

The device part steps on the training thread (CUDA: kernels on the training stream, queued
after the host part was handed to the worker thread, so both run at once). At stage 3 (parameters
on the device) a group whose masters all stay on the device keeps no 16-bit at-rest shard: its
fp32 master is the at-rest parameter, as without offload (stage3/build.py asks
``HostPlacement.master_on_device``), so the device part costs 10 B per element, not 12.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["device_buffers", "ready_order"]


def ready_order(count: int, stage: int) -> list[int]:
    """The order in which the stage's flat buffers' gradients are final in the backward (the
    expected order; a model that calls its modules out of order may differ)."""
    return list(range(count - 1, -1, -1)) if stage == 3 else list(range(count))


def device_buffers(
    numels: Sequence[int], ratio: float | None, budget_numel: int, order: Sequence[int] | None = None
) -> list[bool]:
    """Which flat buffers' masters stay on the device: ``ratio`` is the host's share (None:
    ``"auto"``, the device holds at most ``budget_numel`` elements); ``order``: the buffers in
    the order their gradients are final (default: index order) -- the device takes them from
    the end."""
    total = sum(numels)
    if ratio is None:
        limit = budget_numel
    else:
        # The host share is at least `ratio` (a float product rounded down for the device).
        limit = int((1.0 - ratio) * total + 1e-9) if ratio < 1.0 else 0
    seq = list(range(len(numels))) if order is None else list(order)
    if sorted(seq) != list(range(len(numels))):
        raise ValueError(f"order {seq} is not a permutation of the {len(numels)} flat buffers")
    out = [False] * len(numels)
    used = 0
    for i in reversed(seq):
        if numels[i] > 0 and used + numels[i] <= limit:
            out[i] = True
            used += numels[i]
    return out
