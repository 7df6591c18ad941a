"""CPU and NVMe offload: the only runtime package that knows about it.

It plugs into the runtime at Contract 6's seam (docs/architecture.md): ``api.choose_placement``
calls ``placement_for(settings, device)`` when ``offload_optimizer`` or ``offload_param`` is not
``none``, and gets a ``ShardPlacement`` deciding where fp32 masters and optimizer states live
and how the optimizer step runs; at stage 3 its ``param_store`` (when it has one) keeps the
at-rest parameter shards on the host. See docs/offload.md.

    options.py         the config keys, resolved once (OffloadOptions)
    host.py            host buffers (pinned or not), device<->host copies on side streams, tiles
    adam.py            the CPU Adam/AdamW update of one tile
    cpu_kernel.py      zerorun's one-pass CPU Adam(W) kernel (bf16 or fp32 gradient; a thread pool)
    runner.py          the worker thread the CPU step runs on (its own thread count)
    host_placement.py  HostPlacement: D2H of gradients | tiled CPU step | H2D of parameters
    early_step.py      its base EarlyStep: what starts in backward (early step, deferred write-backs)
    dpu.py             the optional one-step delayed parameter update
    cpu.py             masters and states in host memory
    nvme.py            masters and states in files, stepped in tiles with read-ahead
    twinflow.py        offload_optimizer.ratio: which masters stay on the device
    zenflow.py         zero_optimization.zenflow: selective updates (important columns on the device)
    params.py          stage 3 parameter shards at rest on the host (ParamShardStore)
"""

from __future__ import annotations

import torch

from zerorun.runtime.offload.options import OffloadOptions, options_from_settings
from zerorun.runtime.settings import RuntimeSettings
from zerorun.runtime.sharded_state import DevicePlacement, ShardPlacement

__all__ = ["placement_for", "OffloadOptions"]


def placement_for(settings: RuntimeSettings, device: torch.device) -> ShardPlacement:
    opts = options_from_settings(settings)
    placement: ShardPlacement
    if opts.optimizer_device == "nvme":
        from zerorun.runtime.offload.nvme import NvmePlacement

        placement = NvmePlacement(opts, device)
    elif opts.optimizer_device == "cpu" and opts.zenflow is not None:
        from zerorun.runtime.offload.zenflow import ZenFlowPlacement

        placement = ZenFlowPlacement(opts, device)
    elif opts.optimizer_device == "cpu":
        from zerorun.runtime.offload.cpu import CpuPlacement

        placement = CpuPlacement(opts, device)
    else:
        placement = DevicePlacement(device)
    if opts.param_device != "none":
        from zerorun.runtime.offload.params import DeviceWithParamStore, param_store_for

        store = param_store_for(opts, device)
        if type(placement) is DevicePlacement:
            placement = DeviceWithParamStore(device, store)
        else:
            placement.param_store = store
    return placement
