"""ZeRO stage 3: parameters partitioned in module groups, gathered around their use.

    groups.py       which modules form parameter groups
    param_store.py  where a group's at-rest shard lives (the parameter-offload seam)
    param_group.py  one group's life: shard, gather, release, reduce-scatter gradients
    schedule.py     execution-order recording, prefetch and keep decisions
    hooks.py        forward/backward hooks driving the groups
    stage.py        the Contract 6 stage object
    build.py        build_stage3 (what runtime/api.py calls)
    zero_init.py    zero.Init: partition while constructing
    model_io.py     GatheredParameters, state_dict / load_state_dict / safetensors at stage 3

docs/stage3.md describes the design and its costs.
"""

from __future__ import annotations

from zerorun.runtime.stage3.build import build_stage3
from zerorun.runtime.stage3.param_store import DeviceParamStore, ParamShardStore

__all__ = ["build_stage3", "ParamShardStore", "DeviceParamStore"]
