"""The runtime's view of the config: every value the engine uses, resolved, in one frozen object.

``settings_from_config(cfg)`` reads the validated config model (Contract 1) by attribute, once,
after ``auto`` values were filled where ``initialize`` can; anything still ``auto`` is a
RuntimeConfigError naming the key. The rest of the runtime reads only this object, never the
config model. Defaults live in one place, the schema (``zerorun/config/*_section.py``): the
option objects here have none. Rules between keys live in ``config/rules.py`` (a config reaches
this module only through ``load_config``, which applied them); where a rule decides what a key
does at a stage (offload below its stage), this module asks rules.py, it does not restate it.

Adding a setting: a field in the schema (with its default and description), a field on the
option object it belongs to (or a new frozen option object held by ``RuntimeSettings``), and
one line in ``settings_from_config`` reading it by attribute. docs/architecture.md Contract 6.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from zerorun.errors import RuntimeConfigError
from zerorun.runtime.activations.options import ActivationOptions
from zerorun.runtime.observe.options import ObserveOptions
from zerorun.runtime.precision import LossScaler, MixedPrecisionPolicy

if TYPE_CHECKING:
    from pydantic import BaseModel

    from zerorun.config.schema import ZerorunConfig
    from zerorun.config.zerorun_section import _CheckpointKeys

__all__ = [
    "RuntimeSettings",
    "BatchSettings",
    "PrecisionSettings",
    "LossScaleSettings",
    "BucketSettings",
    "OptimizerSettings",
    "SchedulerSettings",
    "OffloadSettings",
    "Stage3Settings",
    "CheckpointSettings",
    "resolve_batch",
    "settings_from_config",
]

_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class BatchSettings:
    """DeepSpeed's batch triad, resolved: train_batch = micro_batch x grad_accum x world size."""

    train_batch: int
    micro_batch: int
    grad_accum: int
    dataloader_drop_last: bool  # the DataLoader initialize builds drops the last incomplete batch


@dataclass(frozen=True)
class LossScaleSettings:
    """The ``fp16`` section's loss scaling (DeepSpeed's DynamicLossScaler arguments)."""

    loss_scale: float  # 0: dynamic
    initial_scale_power: int
    loss_scale_window: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_loss_scale: float


@dataclass(frozen=True)
class PrecisionSettings:
    policy: MixedPrecisionPolicy  # compute (param), reduce and master dtypes
    fp16: bool  # fp16 training: loss scaling and the overflow check are on
    loss_scaling: LossScaleSettings

    def make_scaler(self) -> LossScaler:
        if not self.fp16:
            return LossScaler.disabled()
        ls = self.loss_scaling
        if ls.loss_scale > 0:
            return LossScaler(dynamic=False, init_scale=ls.loss_scale)
        return LossScaler(
            dynamic=True,
            init_scale=2.0**ls.initial_scale_power,
            window=ls.loss_scale_window,
            hysteresis=ls.hysteresis,
            min_scale=ls.min_loss_scale,
            consecutive_hysteresis=ls.consecutive_hysteresis,
        )


@dataclass(frozen=True)
class BucketSettings:
    reduce_bucket_size: int  # elements per gradient bucket (stages 0-2 cap it: flat_stage.MAX_FLAT_NUMEL)
    allgather_bucket_size: int  # accepted; the write-back gathers in place (no bucket to size)


@dataclass(frozen=True)
class OptimizerSettings:
    """The config's ``optimizer`` section (None: the script passes its own) and clipping."""

    type: str | None
    params: dict[str, Any]  # treat as read-only: copy before filling `auto`s
    allow_untested: bool  # zero_allow_untested_optimizer
    gradient_clipping: float  # 0: no clipping


@dataclass(frozen=True)
class SchedulerSettings:
    type: str | None
    params: dict[str, Any]


@dataclass(frozen=True)
class ZenFlowSettings:
    """``zero_optimization.zenflow`` as zerorun runs it (runtime/offload/zenflow.py): the
    ``"auto"`` values resolved by config rules (docs/offload.md)."""

    topk_ratio: float  # share of each parameter's columns updated on the device every step
    select_interval: int  # optimizer steps between re-selections; 0: select once
    update_interval: int  # optimizer steps between CPU updates of the other columns
    warmup: int  # full_warm_up_rounds: exact offloaded steps first


@dataclass(frozen=True)
class OffloadSettings:
    """``zero_optimization.offload_optimizer`` / ``offload_param`` / ``sub_group_size`` and
    zerorun's offload keys, as they act at the configured stage (``config.rules.offload_in_effect``:
    a device the stage ignores reads ``none``). ``runtime/offload/options.py`` adds what offload
    derives from the rest of the settings (OffloadOptions)."""

    optimizer_device: str  # none | cpu | nvme
    param_device: str  # none | cpu | nvme (stage 3)
    pin_memory: bool  # offload_optimizer.pin_memory
    param_pin_memory: bool  # offload_param.pin_memory
    nvme_path: str | None  # offload_optimizer.nvme_path (set whenever optimizer_device is nvme)
    param_nvme_path: str | None
    buffer_count: int  # offload_optimizer.buffer_count: NVMe tile buffers (read-ahead depth + 1)
    param_buffer_count: int
    sub_group_size: int  # NVMe tile (elements); the CPU pipeline uses min(this, PIPELINE_TILE)
    delayed_update: bool  # zerorun.delayed_param_update, where it acts (config.rules)
    delayed_warmup: int  # zerorun.delayed_param_update_warmup
    cpu_threads: int  # zerorun.offload_cpu_threads; 0: automatic
    # Twin-Flow (offload_optimizer.ratio): the share of the optimizer states kept on the host;
    # None for "auto": the GPU keeps as many shard elements as ``device_budget_numel``.
    ratio: float | None
    device_budget_numel: int  # zerorun.offload_gpu_budget_gb / (fp32 master + states bytes)
    zenflow: ZenFlowSettings | None  # zero_optimization.zenflow, where it acts (config.rules)

    @property
    def enabled(self) -> bool:
        return self.optimizer_device != "none" or self.param_device != "none"


@dataclass(frozen=True)
class Stage3Settings:
    """Stage 3's knobs: DeepSpeed's ``stage3_*`` keys (``auto`` reads as the schema default)
    and zerorun's ``zerorun.stage3_*``."""

    persistence_threshold: int  # stage3_param_persistence_threshold
    prefetch_numel: int  # stage3_prefetch_bucket_size
    max_live_numel: int  # stage3_max_live_parameters
    max_reuse_distance: int  # stage3_max_reuse_distance
    group_modules: tuple[str, ...] | None  # zerorun.stage3_group_modules
    group_min_numel: int
    reshard_after_forward: bool
    check_order: bool


@dataclass(frozen=True)
class CheckpointSettings:
    gather_16bit_weights_on_model_save: bool  # stage3_gather_16bit_weights_on_model_save
    # zerorun.checkpoint: what the engine saves and resumes by itself (runtime/checkpoint/
    # options.py adds the launcher's --resume_from / --save_on_preemption)
    dir: str | None
    auto_resume: bool
    every_n_steps: int
    keep_last: int
    async_save: bool  # zerorun.checkpoint.async


@dataclass(frozen=True)
class RuntimeSettings:
    stage: int  # zero_optimization.stage
    batch: BatchSettings
    precision: PrecisionSettings
    buckets: BucketSettings
    optimizer: OptimizerSettings
    scheduler: SchedulerSettings
    offload: OffloadSettings
    stage3: Stage3Settings
    checkpoint: CheckpointSettings
    observe: ObserveOptions  # steps_per_print, wall_clock_breakdown, monitors, flops_profiler
    activation: ActivationOptions  # activation_checkpointing (zerorun.checkpointing)


def _concrete(value: Any, key: str, how: str) -> Any:
    if value == "auto":
        raise RuntimeConfigError(f"{key} is 'auto' and zerorun.initialize cannot fill it: {how}")
    return value


def _or_default(section: BaseModel, name: str) -> Any:
    """The value of a key that may be ``auto``, with ``auto`` read as the schema's default (the
    one place it is written)."""
    value = getattr(section, name)
    return type(section).model_fields[name].get_default(call_default_factory=True) if value == "auto" else value


def resolve_batch(
    train_batch: int | None, micro: int | None, accum: int | None, world: int
) -> tuple[int, int, int]:
    """DeepSpeed's batch triad, train_batch = micro * accum * world, for the concrete values
    ``initialize`` has (None: not given or ``auto``). The rule is ``zerorun.config``'s (one
    rule, one place: config/batch.py); here a contradiction or a batch size still unknown is a
    RuntimeConfigError naming the keys. Returns (train_batch, micro, accum)."""
    from zerorun.config.batch import resolve_batch as triad
    from zerorun.errors import ConfigError

    try:
        res = triad(train_batch, micro, accum, world)
    except ConfigError as err:
        raise RuntimeConfigError(
            f"train_batch_size must equal train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
            f"world size ({world}): {err}"
        ) from None
    train, micro, accum = res.train_batch_size, res.train_micro_batch_size_per_gpu, res.gradient_accumulation_steps
    if res.open or train is None or micro is None or accum is None:
        raise RuntimeConfigError(
            "train_micro_batch_size_per_gpu (or train_batch_size) is missing or 'auto' and zerorun.initialize "
            "cannot infer it: set it in the config, or pass training_data as a DataLoader with a batch_size"
        )
    return train, micro, accum


def _opt_int(value: int | str | None) -> int | None:
    return None if value is None or value == "auto" else int(value)


def _zenflow(cfg: ZerorunConfig, opt_dev: str) -> ZenFlowSettings | None:
    from zerorun.config.rules import zenflow_intervals

    zf = cfg.zero_optimization.zenflow
    if zf is None or opt_dev != "cpu":
        return None
    select, update = zenflow_intervals(zf)
    return ZenFlowSettings(
        topk_ratio=float(zf.topk_ratio), select_interval=select, update_interval=update, warmup=zf.full_warm_up_rounds
    )


def settings_from_config(
    cfg: ZerorunConfig, *, world_size: int, micro_batch_hint: int | None = None
) -> RuntimeSettings:
    """The validated config model (Contract 1, after ``load_config``'s rules) -> RuntimeSettings."""
    from zerorun.config.rules import delayed_update_in_effect, offload_in_effect
    from zerorun.estimate import offload_budget_numel

    micro = _opt_int(cfg.train_micro_batch_size_per_gpu)
    if micro is None and micro_batch_hint is not None:
        micro = micro_batch_hint
    train_batch, micro, accum = resolve_batch(
        _opt_int(cfg.train_batch_size), micro, _opt_int(cfg.gradient_accumulation_steps), world_size
    )
    fp16 = bool(_concrete(cfg.fp16.enabled, "fp16.enabled", "set true or false"))
    bf16 = bool(_concrete(cfg.bf16.enabled, "bf16.enabled", "set true or false"))
    param_dtype = torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32
    comm = cfg.communication_data_type
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype,
        reduce_dtype=_COMM_DTYPES[comm] if comm is not None else torch.float32,
        master_dtype=torch.float32,
    )
    f16 = cfg.fp16
    clip = _concrete(cfg.gradient_clipping, "gradient_clipping", "set a number (0 disables clipping)")
    zero = cfg.zero_optimization
    reduce_bucket = _concrete(
        zero.reduce_bucket_size, "zero_optimization.reduce_bucket_size", "set a number of elements"
    )
    opt_dev, param_dev = offload_in_effect(zero.stage, zero.offload_optimizer.device, zero.offload_param.device)
    zr = cfg.zerorun
    # CheckpointSection is made with pydantic's create_model (for its `async` key), which the type
    # checker cannot see through: its fields are those of the class it extends.
    ck = cast("_CheckpointKeys", zr.checkpoint)
    return RuntimeSettings(
        stage=zero.stage,
        batch=BatchSettings(
            train_batch=train_batch,
            micro_batch=micro,
            grad_accum=accum,
            dataloader_drop_last=cfg.dataloader_drop_last,
        ),
        precision=PrecisionSettings(
            policy=policy,
            fp16=fp16,
            loss_scaling=LossScaleSettings(
                loss_scale=float(f16.loss_scale),
                initial_scale_power=f16.initial_scale_power,
                loss_scale_window=f16.loss_scale_window,
                hysteresis=f16.hysteresis,
                consecutive_hysteresis=f16.consecutive_hysteresis,
                min_loss_scale=float(f16.min_loss_scale),
            ),
        ),
        buckets=BucketSettings(
            reduce_bucket_size=int(reduce_bucket), allgather_bucket_size=zero.allgather_bucket_size
        ),
        optimizer=OptimizerSettings(
            type=cfg.optimizer.type if cfg.optimizer is not None else None,
            params=dict(cfg.optimizer.params) if cfg.optimizer is not None else {},
            allow_untested=cfg.zero_allow_untested_optimizer,
            gradient_clipping=float(clip),
        ),
        scheduler=SchedulerSettings(
            type=cfg.scheduler.type if cfg.scheduler is not None else None,
            params=dict(cfg.scheduler.params) if cfg.scheduler is not None else {},
        ),
        offload=OffloadSettings(
            optimizer_device=opt_dev,
            param_device=param_dev,
            pin_memory=zero.offload_optimizer.pin_memory,
            param_pin_memory=zero.offload_param.pin_memory,
            nvme_path=zero.offload_optimizer.nvme_path,
            param_nvme_path=zero.offload_param.nvme_path,
            buffer_count=zero.offload_optimizer.buffer_count,
            param_buffer_count=zero.offload_param.buffer_count,
            sub_group_size=zero.sub_group_size,
            delayed_update=delayed_update_in_effect(cfg),
            delayed_warmup=zr.delayed_param_update_warmup,
            cpu_threads=zr.offload_cpu_threads,
            ratio=None if zero.offload_optimizer.ratio == "auto" else float(zero.offload_optimizer.ratio),
            device_budget_numel=offload_budget_numel(cfg),
            zenflow=_zenflow(cfg, opt_dev),
        ),
        stage3=Stage3Settings(
            persistence_threshold=int(_or_default(zero, "stage3_param_persistence_threshold")),
            prefetch_numel=int(_or_default(zero, "stage3_prefetch_bucket_size")),
            max_live_numel=zero.stage3_max_live_parameters,
            max_reuse_distance=zero.stage3_max_reuse_distance,
            group_modules=tuple(zr.stage3_group_modules) if zr.stage3_group_modules else None,
            group_min_numel=zr.stage3_group_min_numel,
            reshard_after_forward=zr.stage3_reshard_after_forward,
            check_order=zr.stage3_check_order,
        ),
        checkpoint=CheckpointSettings(
            gather_16bit_weights_on_model_save=zero.stage3_gather_16bit_weights_on_model_save,
            dir=ck.dir,
            auto_resume=ck.auto_resume,
            every_n_steps=ck.every_n_steps,
            keep_last=ck.keep_last,
            async_save=getattr(ck, "async"),  # a Python keyword: no attribute syntax
        ),
        observe=ObserveOptions.from_config(cfg),
        activation=ActivationOptions.from_config(cfg),
    )
