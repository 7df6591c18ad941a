"""``zerorun.initialize``: DeepSpeed's entry point, backed by zerorun's runtime.

    engine, optimizer, dataloader, lr_scheduler = zerorun.initialize(
        model=model, optimizer=None, model_parameters=None, config=None,
        lr_scheduler=None, training_data=None)

Reads top to bottom: config -> process group and device -> settings (``auto`` filled) ->
trainable parameters and their optimizer groups -> stage (with the placement of the optimizer
state) -> optimizer over the master shards -> scheduler -> data loader -> Engine.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from zerorun.errors import RuntimeConfigError
from zerorun.runtime import optimizer as opt_lib
from zerorun.runtime.collectives import Communicator
from zerorun.runtime.distributed import DistContext, init_distributed
from zerorun.runtime.engine import Engine
from zerorun.runtime.flat_params import TrainableParam, collect_trainable
from zerorun.runtime.scheduler import build_scheduler
from zerorun.runtime.settings import RuntimeSettings, settings_from_config
from zerorun.runtime.sharded_state import DevicePlacement, ShardPlacement
from zerorun.runtime.stage_protocol import Stage

if TYPE_CHECKING:
    from zerorun.config.schema import ZerorunConfig

__all__ = ["initialize", "load_runtime_config", "build_stage", "choose_placement"]


def load_runtime_config(config: Any, world_size: int) -> ZerorunConfig:
    """A path, a dict, an already-loaded config, or None (the launcher's config from the
    environment, Contract 2) -> the validated config model (Contract 1), its rules applied."""
    from zerorun.config import LoadedConfig, ZerorunConfig, load_config

    if config is None:
        text = os.environ.get("ZERORUN_CONFIG_JSON")
        if text:
            try:
                config = json.loads(text)
            except json.JSONDecodeError as exc:
                raise RuntimeConfigError(f"ZERORUN_CONFIG_JSON is not valid JSON: {exc}") from None
        elif os.environ.get("ZERORUN_CONFIG"):
            config = os.environ["ZERORUN_CONFIG"]
        else:
            raise RuntimeConfigError(
                "no config: pass config=PATH_OR_DICT to zerorun.initialize, or launch with "
                "`zerorun ... --config FILE`"
            )
    batch = _launcher_batch(world_size)
    # With the launcher's batch the config's own triad (made for another world size) is not
    # checked against this one: it is replaced.
    checked = None if batch else world_size
    if isinstance(config, (str, Path, dict)):
        return _with_batch(load_config(config, world_size=checked).config, batch)
    if isinstance(config, LoadedConfig):
        return _with_batch(config.config, batch)
    if isinstance(config, ZerorunConfig):
        # A model built in Python has not been through config/rules.py: load its values.
        return _with_batch(load_config(config.to_dict(only_set=True), world_size=checked).config, batch)
    raise RuntimeConfigError(
        f"config must be a path, a dict or a zerorun config (zerorun.config.load_config), not {type(config).__name__}"
    )


def _launcher_batch(world_size: int) -> dict[str, int] | None:
    """The batch triad the launcher chose for this world size (Contract 2's ZERORUN_BATCH: a
    restart without the nodes that failed, docs/fault-tolerance.md), or None."""
    text = os.environ.get("ZERORUN_BATCH")
    if not text:
        return None
    try:
        data = json.loads(text)
        if int(data["world_size"]) != world_size:
            return None  # not this job's world (a script that made a group of its own)
        return {k: int(data[k]) for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")}
    except (ValueError, KeyError, TypeError) as exc:
        raise RuntimeConfigError(f"ZERORUN_BATCH={text!r} is not the launcher's batch JSON: {exc}") from None


def _with_batch(cfg: ZerorunConfig, batch: dict[str, int] | None) -> ZerorunConfig:
    return cfg if batch is None else cfg.model_copy(update=batch)


def choose_placement(settings: RuntimeSettings, device: torch.device) -> ShardPlacement:
    """Where master shards and optimizer states live. Offload is offload.py's business."""
    if not settings.offload.enabled:
        return DevicePlacement(device)
    from zerorun.runtime import offload

    return offload.placement_for(settings, device)


def build_stage(
    settings: RuntimeSettings,
    module: nn.Module,
    trainable: list[TrainableParam],
    comm: Communicator,
    device: torch.device,
    placement: ShardPlacement,
) -> Stage:
    if settings.stage in (0, 1, 2):
        from zerorun.runtime.flat_stage import build_flat_stage

        if any(hasattr(p, "_zerorun_init") for p in module.parameters()):
            # Built under zerorun.zero.Init (a stage-3 tool): stages 0-2 need whole parameters.
            from zerorun.runtime.stage3.zero_init import materialize_all

            materialize_all(module)

        return build_flat_stage(
            settings.stage,
            trainable,
            policy=settings.precision.policy,
            comm=comm,
            device=device,
            bucket_numel=settings.buckets.reduce_bucket_size,
            placement=placement,
            module=module,
        )
    if settings.stage == 3:
        from zerorun.runtime.stage3 import build_stage3

        return build_stage3(settings, module, trainable, comm=comm, device=device, placement=placement)
    raise RuntimeConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3 (you have {settings.stage})")


def _move_rest(module: nn.Module, trainable_ids: set[int], device: torch.device, dtype: torch.dtype) -> None:
    """Frozen parameters and buffers go to the device; floating ones to the compute dtype
    (DeepSpeed halves the whole module in fp16/bf16)."""
    for sub in module.modules():
        for _name, p in sub._parameters.items():
            if p is None or id(p) in trainable_ids:
                continue
            target = dtype if p.is_floating_point() else p.dtype
            if p.device != device or p.dtype != target:
                p.data = p.data.to(device, target)
        for name, b in sub._buffers.items():
            if b is None:
                continue
            target = dtype if b.is_floating_point() else b.dtype
            if b.device != device or b.dtype != target:
                sub._buffers[name] = b.to(device, target)


def _micro_hint(training_data: object) -> int | None:
    return (
        getattr(training_data, "batch_size", None)
        if isinstance(training_data, torch.utils.data.DataLoader)
        else None
    )


def _groups(
    module: nn.Module, user_opt: Optimizer | None, model_parameters: Any
) -> tuple[dict[int, int] | None, list[dict[str, Any]]]:
    """(id(param) -> group index, per-group hyperparameters) from the user's optimizer, or from
    DeepSpeed-style ``model_parameters``, or one group of everything."""
    if user_opt is not None:
        hypers = [{k: v for k, v in g.items() if k != "params"} for g in user_opt.param_groups]
        return opt_lib.user_group_index(user_opt), hypers
    groups = opt_lib.normalize_model_parameters(model_parameters)
    if groups is None:
        return None, [{}]
    index = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
    return index, [{k: v for k, v in g.items() if k != "params"} for g in groups]


def initialize(
    args: object = None,
    model: nn.Module | None = None,
    optimizer: Optimizer | Callable[[Iterable[Any]], Optimizer] | None = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    mpu: object = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: Any = None,
    config_params: Any = None,
) -> tuple[Engine, Optimizer, Any, Any]:
    if model is None:
        raise RuntimeConfigError("zerorun.initialize needs model=<your torch.nn.Module>")
    if mpu is not None:
        raise RuntimeConfigError("model parallelism (mpu=...) is not supported by zerorun: pass mpu=None")
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "zerorun_config", None)

    ctx: DistContext = init_distributed()
    cfg = load_runtime_config(config, ctx.world_size)
    settings = settings_from_config(
        cfg, world_size=ctx.world_size, micro_batch_hint=_micro_hint(training_data)
    )
    comm = Communicator(ctx.group, ctx.device)

    user_opt: Optimizer | None = None
    if isinstance(optimizer, Optimizer):
        user_opt = optimizer
        if settings.optimizer.type is not None and ctx.rank == 0:
            warnings.warn(
                "zerorun.initialize got an optimizer and the config has an `optimizer` section: "
                "the script's optimizer is used (as DeepSpeed does)",
                stacklevel=2,
            )
    elif optimizer is not None and not callable(optimizer):
        raise RuntimeConfigError(
            f"optimizer must be a torch.optim.Optimizer or a callable(params) -> Optimizer, not {type(optimizer).__name__}"
        )
    group_of, hypers = _groups(model, user_opt, model_parameters)
    if group_of is not None:
        mine = {id(p) for p in model.parameters()}
        strangers = sum(1 for pid in group_of if pid not in mine)
        if strangers:
            what = "optimizer" if user_opt is not None else "model_parameters"
            raise RuntimeConfigError(
                f"the {what} passed to zerorun.initialize holds {strangers} tensor(s) that are not parameters "
                "of `model`: build it from model.parameters() (after any change to the model)"
            )
    trainable, skipped = collect_trainable(model, group_of)
    if skipped and ctx.rank == 0:
        warnings.warn(
            f"{len(skipped)} trainable parameter(s) are not in the optimizer and will not be updated "
            f"(first: {skipped[0]})",
            stacklevel=2,
        )
    placement = choose_placement(settings, ctx.device)
    stage = build_stage(settings, model, trainable, comm, ctx.device, placement)
    _move_rest(model, {id(t.param) for t in trainable}, ctx.device, settings.precision.policy.param_dtype)

    state = stage.state
    if user_opt is not None:
        torch_opt = opt_lib.rebind_user_optimizer(
            user_opt, state.param_groups(hypers), settings.optimizer.allow_untested
        )
    elif optimizer is not None and not isinstance(optimizer, Optimizer):  # DeepSpeed's client-optimizer factory
        torch_opt = optimizer(state.param_groups(hypers))
        if not isinstance(torch_opt, Optimizer):
            raise RuntimeConfigError(
                "the optimizer callable passed to zerorun.initialize did not return an Optimizer"
            )
        opt_lib.check_elementwise(type(torch_opt), settings.optimizer.allow_untested)
    elif settings.optimizer.type is not None:
        # (A script's own optimizer, above, wins over the config's, `auto` values included.)
        torch_opt = opt_lib.build_from_config(
            settings.optimizer.type,
            dict(settings.optimizer.params),
            state.param_groups(hypers),
            placement.optimizer_device,
        )
    else:
        raise RuntimeConfigError(
            "no optimizer: add an `optimizer: {type: AdamW, params: {lr: ...}}` section to the config, "
            "or pass optimizer=torch.optim.AdamW(model.parameters(), ...) to zerorun.initialize"
        )
    state.attach(torch_opt)

    scheduler = _build_lr_scheduler(settings, torch_opt, lr_scheduler, user_opt)
    loader = _build_loader(training_data, settings, ctx, collate_fn)
    engine = Engine(
        module=model,
        stage=stage,
        settings=settings,
        comm=comm,
        optimizer=torch_opt,
        lr_scheduler=scheduler,
        scaler=settings.precision.make_scaler(),
        device=ctx.device,
    )
    engine.training_dataloader = loader
    _attach_checkpointing(engine)
    return engine, torch_opt, loader, scheduler


def _attach_checkpointing(engine: Engine) -> None:
    """Periodic/async saves, auto-resume and preemption (runtime/checkpoint/autosave.py) when
    the config's `zerorun.checkpoint` or the launcher (--resume_from, --save_on_preemption)
    asks for them; the resume happens here, before the script gets the engine."""
    from zerorun.runtime.checkpoint.options import checkpoint_options

    options = checkpoint_options(engine.settings.checkpoint)
    if options.load_dir is None and not options.active:
        return
    from zerorun.runtime.checkpoint.autosave import EngineCheckpointing

    timeout = os.environ.get("ZERORUN_PG_TIMEOUT")
    engine.checkpointing = EngineCheckpointing(engine, options, pg_timeout_s=float(timeout) if timeout else None)
    engine.checkpointing.resume()


def _build_lr_scheduler(
    settings: RuntimeSettings, torch_opt: Optimizer, lr_scheduler: Any, user_opt: Optimizer | None
) -> Any:
    if lr_scheduler is not None:
        if hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "optimizer"):
            if lr_scheduler.optimizer is not torch_opt:
                raise RuntimeConfigError(
                    "the lr_scheduler instance is bound to an optimizer zerorun does not use: pass the same "
                    "optimizer to initialize, or pass lr_scheduler=lambda opt: YourScheduler(opt, ...)"
                )
            return lr_scheduler
        if callable(lr_scheduler):
            return lr_scheduler(torch_opt)
        raise RuntimeConfigError("lr_scheduler must be a scheduler instance or a callable(optimizer)")
    if settings.scheduler.type is not None:
        return build_scheduler(settings.scheduler.type, settings.scheduler.params, torch_opt)
    return None


def _build_loader(
    training_data: Any, settings: RuntimeSettings, ctx: DistContext, collate_fn: Callable[..., object] | None
) -> Any:
    if training_data is None:
        return None
    if isinstance(training_data, torch.utils.data.DataLoader):
        return training_data
    # A DataLoader/DistributedSampler that can continue mid-pass after a resume.
    from zerorun.runtime.checkpoint.data_position import ResumableLoader, ResumableSampler

    sampler = ResumableSampler(training_data, num_replicas=ctx.world_size, rank=ctx.rank)
    return ResumableLoader(
        training_data,
        batch_size=settings.batch.micro_batch,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=settings.batch.dataloader_drop_last,
    )
