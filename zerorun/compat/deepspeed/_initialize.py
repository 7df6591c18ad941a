"""``deepspeed.initialize``: DeepSpeed's ways of passing a config (``config``, ``config_params``,
``args.deepspeed_config``, or the launcher's), then ``zerorun.initialize``, then the zerorun
``Engine`` wrapped in a ``DeepSpeedEngine`` (runtime/engine.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerorun.compat.deepspeed._config_view import runtime_view
from zerorun.compat.deepspeed._surface import unsupported
from zerorun.compat.deepspeed.runtime.engine import DeepSpeedEngine
from zerorun.errors import RuntimeConfigError
from zerorun.runtime.settings import RuntimeSettings

__all__ = ["initialize", "check_not_accelerate_on_cpu_ranks"]


def _config_dict(args: Any, config: Any, config_params: Any) -> dict[str, Any]:
    """The config as DeepSpeed users pass it -> a plain dict (``engine.config``)."""
    given = config if config is not None else config_params
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if given is not None and from_args is not None:
        raise RuntimeConfigError(
            "deepspeed.initialize got a config twice: args.deepspeed_config and config=...; pass one "
            "(DeepSpeed refuses this too)"
        )
    source = given if given is not None else from_args
    if source is None:
        text = os.environ.get("ZERORUN_CONFIG_JSON")
        if text:
            return dict(json.loads(text))
        source = os.environ.get("ZERORUN_CONFIG")
    if source is None:
        raise RuntimeConfigError(
            "deepspeed.initialize has no config: pass config=PATH_OR_DICT, args with --deepspeed_config, or "
            "give the script's --deepspeed/--deepspeed_config argument to zerorun"
        )
    if isinstance(source, dict):
        return source
    from zerorun.config import load_config

    if isinstance(source, (str, Path)):
        return load_config(source).config.to_dict()
    return getattr(source, "config", source).to_dict()


def _elementwise_standin(optimizer: Any) -> bool:
    """Optimizers of this layer (deepspeed.ops.adam) are torch Adam with DeepSpeed's
    constructor: elementwise, though not torch's own class."""
    from zerorun.compat.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    return type(optimizer) in (DeepSpeedCPUAdam, FusedAdam)


def check_not_accelerate_on_cpu_ranks(env: dict[str, str], world_size: int, cuda: bool) -> None:
    """accelerate takes its DeepSpeed path on CPU but counts one process there whatever the
    world size (it only knows GPU backends for it): batch sizes and data sharding would be
    wrong. Say so instead of failing later on a batch-size mismatch. (Not reached on
    zerorun's CPU ranks, where accelerate is made to count them: compat/accelerate_cpu.py;
    this is for the layer activated some other way.)"""
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true" and world_size > 1 and not cuda:
        raise RuntimeConfigError(
            f"Hugging Face Trainer/accelerate with DeepSpeed on {world_size} CPU ranks: accelerate counts one "
            "process on CPU (its DeepSpeed path needs GPUs), so batch sizes and data sharding would be wrong. "
            "Launch with `zerorun --deepspeed-compat --device cpu` (which makes accelerate count every CPU rank), "
            "run one CPU rank, or run on GPUs (several ranks may share one: --ranks_per_gpu)."
        )


def _evaluation_only_optimizer(groups: Any) -> torch.optim.Optimizer:
    # zerorun's engine always has an optimizer; DeepSpeed's may have none (ZeRO-3 inference,
    # Trainer.evaluate before train). SGD without momentum keeps no state; the engine wrapper
    # refuses backward/step, so it never runs.
    return torch.optim.SGD(groups, lr=0.0)


def info_line(settings: RuntimeSettings) -> str:
    """DeepSpeed's ``DeepSpeed info: version=...`` line (logged on ``deepspeed.utils.logger`` at
    ``initialize``; tools look for it), with what zerorun runs: stage, precision, offload."""
    from zerorun.compat.activation import COMPAT_VERSION

    if settings.precision.fp16:
        precision = "fp16"
    elif settings.precision.policy.param_dtype == torch.bfloat16:
        precision = "bf16"
    else:
        precision = "fp32"
    opt_device, param_device = settings.offload.optimizer_device, settings.offload.param_device
    return (
        f"DeepSpeed info: version={COMPAT_VERSION}, git-hash=None, git-branch=None "
        f"(zerorun: zero stage={settings.stage}, precision={precision}, "
        f"offload_optimizer={opt_device}, offload_param={param_device})"
    )


def _param_order(model: nn.Module | None, optimizer: Any, model_parameters: Any) -> list[str] | None:
    """The names of the parameters in the order the script handed them over (a torch optimizer's
    param groups, or model_parameters as a list of parameters or of group dicts), for the
    DeepSpeed-layout checkpoint files; None when not given as such (an iterator is not read
    twice): the module's order then."""
    if model is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        source: Any = optimizer.param_groups
    elif isinstance(model_parameters, (list, tuple)):
        source = model_parameters
    else:
        return None
    groups = [g["params"] for g in source] if source and isinstance(source[0], dict) else [source]
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for group in groups for p in (group if isinstance(group, (list, tuple)) else [group])
            if id(p) in name_of]


def _log_info(engine: Any) -> None:
    from zerorun.compat.deepspeed.utils import log_dist

    log_dist(info_line(engine.settings), ranks=[0])


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """``deepspeed.initialize``: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``."""
    del distributed_port, dist_init_required
    if mesh_param is not None:
        unsupported("deepspeed.initialize(mesh_param=...)", "device meshes (sequence/tensor parallelism) are not supported")
    import zerorun

    cfg = _config_dict(args, config, config_params)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from zerorun.compat import accelerate_cpu

        device = os.environ.get("ZERORUN_DEVICE")
        cuda = device == "cuda" or (device is None and torch.cuda.is_available())
        # On zerorun's CPU ranks accelerate is patched to count every process (accelerate_cpu.py).
        if not accelerate_cpu.wanted():
            check_not_accelerate_on_cpu_ranks(dict(os.environ), torch.distributed.get_world_size(), cuda)
    runtime_cfg = runtime_view(cfg)
    if optimizer is not None and _elementwise_standin(optimizer):
        runtime_cfg = dict(runtime_cfg, zero_allow_untested_optimizer=True)
    from zerorun.compat.deepspeed.runtime.zero.partition_parameters import deepspeed_state_dict_semantics

    deepspeed_state_dict_semantics()
    evaluation_only = optimizer is None and not cfg.get("optimizer")
    if evaluation_only:
        optimizer = _evaluation_only_optimizer
    engine, opt, loader, sched = zerorun.initialize(
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        collate_fn=collate_fn,
        config=runtime_cfg,
    )
    ds_engine = DeepSpeedEngine(engine, cfg, training_dataloader=loader, evaluation_only=evaluation_only,
                                param_order=_param_order(model, optimizer, model_parameters))
    _log_info(engine)
    return ds_engine, (None if evaluation_only else opt), loader, sched
