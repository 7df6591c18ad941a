"""``build_stage3``: trainable parameters -> groups -> at-rest shards + master shards + hooks.

Values come from the parameters as the user built them: full tensors (anywhere; each rank
copies only its shard to the device, then the full tensor is dropped), or parameters partitioned
by ``zerorun.zero.Init`` (each is all-gathered once, one parameter at a time, to cut the group's
shards -- never the whole model at once). The fp32 values become the master shards, so masters
start exactly at the user's initialization, not at its 16-bit rounding.

Where the fp32 values are cut: on the placement's ``optimizer_device`` (the host when the
optimizer is offloaded, the training device otherwise), one group at a time -- each group's
masters are made (``placement.make_master``) as soon as the group is built, and its fp32 shards
dropped before the next group is cut. So initialize never holds 4 bytes per parameter of fp32
values on the GPU under optimizer offload (DeepSpeed builds them on the host too), and on the
host only one group's fp32 values exist besides the masters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from zerorun.runtime.collectives import Communicator
from zerorun.runtime.flat_params import TrainableParam
from zerorun.runtime.partition import SLOT_ALIGN_BYTES, FlatLayout, ParamSpec, plan_flat_buffers
from zerorun.runtime.precision import dtype_name
from zerorun.runtime.settings import RuntimeSettings
from zerorun.runtime.sharded_state import DevicePlacement, ShardedOptimizerState, ShardPlacement
from zerorun.runtime.stage3.groups import plan_groups
from zerorun.runtime.stage3.hooks import Stage3Hooks
from zerorun.runtime.stage3.model_io import install_state_dict_hooks
from zerorun.runtime.stage3.param_group import ParamGroup
from zerorun.runtime.stage3.param_store import DeviceParamStore, ParamShardStore
from zerorun.runtime.stage3.schedule import Schedule
from zerorun.runtime.stage3.stage import Stage3

__all__ = ["build_stage3", "full_values"]

_ONE_BUFFER = 1 << 62  # a group is one flat buffer per optimizer param group, whatever its size


def full_values(p: nn.Parameter) -> torch.Tensor:
    """The parameter's full values, flattened. Collective for a ``zero.Init`` parameter (every
    rank must call it for the same parameters in the same order)."""
    handle = getattr(p, "_zerorun_init", None)
    if handle is not None:
        return handle.materialize()
    return p.detach().reshape(-1)


def _fp32_shards(
    layouts: list[FlatLayout], params: list[list[nn.Parameter]], rank: int, device: torch.device
) -> list[torch.Tensor]:
    out = []
    for layout, ps in zip(layouts, params, strict=True):
        start, end = layout.shard_range(rank)
        shard = torch.zeros(end - start, dtype=torch.float32, device=device)
        for slot, p in zip(layout.slots, ps, strict=True):
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            values = full_values(p)  # every slot, also outside our range: may be collective
            if lo < hi:
                shard[lo - start : hi - start].copy_(values[lo - slot.offset : hi - slot.offset])
            del values
        out.append(shard)
    return out


def _init_of(fp32: list[torch.Tensor], i: int) -> Callable[[], torch.Tensor]:
    return lambda: fp32[i]


def _shape(p: nn.Parameter) -> tuple[int, ...]:
    handle = getattr(p, "_zerorun_init", None)
    return tuple(handle.shape) if handle is not None else tuple(p.shape)


def _materialize_untrained(module: nn.Module, trained: set[int]) -> None:
    """Parameters ``zero.Init`` partitioned that stage 3 does not train (frozen ones) are kept
    whole and replicated, like at stages 0-2."""
    seen: set[int] = set()
    for _name, p in module.named_parameters():
        if id(p) in trained or id(p) in seen:
            continue
        seen.add(id(p))
        handle = getattr(p, "_zerorun_init", None)
        if handle is not None:
            values = handle.materialize().view(handle.shape)
            handle.detach_from(p)
            p.data = values.to(handle.dtype)


def build_stage3(
    settings: RuntimeSettings,
    module: nn.Module,
    trainable: list[TrainableParam],
    *,
    comm: Communicator,
    device: torch.device,
    placement: ShardPlacement,
) -> Stage3:
    opts = settings.stage3
    policy = settings.precision.policy
    store: ParamShardStore = placement.param_store or DeviceParamStore(device)
    # Masters and shards both on the device: the fp32 master shard is the at-rest parameter
    # (the master of an fp32 shard is the shard itself, DevicePlacement.make_master) -- also for
    # the groups whose masters a Twin-Flow partial offload keeps on the device
    # (HostPlacement.master_on_device; its _device_master takes an fp32 device shard as is).
    kept = getattr(placement, "master_on_device", None)

    def rest_dtype_of(layouts: list[FlatLayout]) -> torch.dtype:
        if not isinstance(store, DeviceParamStore):
            return policy.param_dtype
        if isinstance(placement, DevicePlacement) or (kept is not None and layouts and all(kept(lay.index) for lay in layouts)):
            return torch.float32
        return policy.param_dtype
    world, rank = comm.world_size, comm.rank
    plans = plan_groups(
        module,
        trainable,
        persistence_threshold=opts.persistence_threshold,
        class_names=opts.group_modules,
        min_numel=opts.group_min_numel,
    )
    # The layouts of every group first (metadata only): the placement plans all masters
    # (Twin-Flow's split, ZenFlow's columns) before the first make_master.
    layouts_all: list[FlatLayout] = []
    planned: list[tuple[list[FlatLayout], list[list[nn.Parameter]]]] = []
    for plan in plans:
        ordered = sorted(plan.params, key=lambda t: t.group)  # stable: registration order kept
        by_name = {t.name: t.param for t in ordered}
        specs = [
            ParamSpec(t.name, _shape(t.param), dtype_name(policy.param_dtype), t.group, t.aliases)
            for t in ordered
        ]
        layouts = [
            dataclasses.replace(layout, index=len(layouts_all) + j)
            for j, layout in enumerate(
                plan_flat_buffers(
                    specs, num_shards=world, bucket_numel=_ONE_BUFFER, slot_align_bytes=SLOT_ALIGN_BYTES
                )
            )
        ]
        planned.append((layouts, [[by_name[s.name] for s in layout.slots] for layout in layouts]))
        layouts_all.extend(layouts)
    placement.plan([layout.shard_numel for layout in layouts_all], layouts_all, rank)
    # The fp32 initial values are cut where the placement keeps its masters (a Twin-Flow master
    # kept on the device is copied up from there, one group at a time).
    home = placement.optimizer_device
    masters: list[torch.Tensor] = []
    groups: list[ParamGroup] = []
    with torch.no_grad():
        for gi, (plan, (layouts, params)) in enumerate(zip(plans, planned, strict=True)):
            fp32 = _fp32_shards(layouts, params, rank, home)
            for ps in params:
                for p in ps:
                    handle = getattr(p, "_zerorun_init", None)
                    if handle is not None:
                        handle.detach_from(p)
            group = ParamGroup(
                gi,
                plan.name,
                plan.module,
                layouts,
                params,
                comm=comm,
                device=device,
                param_dtype=policy.param_dtype,
                reduce_dtype=policy.reduce_dtype,
                store=store,
                persistent=plan.persistent,
                fp32_shards=fp32,
                rest_dtype=rest_dtype_of(layouts),
            )
            for li, layout in enumerate(layouts):
                masters.append(placement.make_master(layout.index, group.at_rest[li], _init_of(fp32, li)))
            del fp32  # the masters own these now (or they were copies that can go)
            groups.append(group)
        _materialize_untrained(module, {id(t.param) for t in trainable})
    state = ShardedOptimizerState.from_masters(layouts_all, rank, masters, placement)
    schedule = Schedule(
        groups,
        prefetch_numel=opts.prefetch_numel,
        max_live_numel=opts.max_live_numel,
        max_reuse_distance=opts.max_reuse_distance,
    )
    hooks = Stage3Hooks(
        module,
        groups,
        schedule,
        reshard_after_forward=opts.reshard_after_forward,
        check_order=opts.check_order,
    )
    stage = Stage3(groups, hooks, schedule, state, comm)
    for g in groups:
        g.stage = stage  # model_io updates master shards when parameters are written
    stage.io_handles = install_state_dict_hooks(module)
    return stage
