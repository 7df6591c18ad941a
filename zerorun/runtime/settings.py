"""The runtime's view of the config: every value the engine uses, resolved, in one frozen object.

Built from ``zerorun.config``'s validated model (Contract 1) after ``auto`` values were filled
where ``initialize`` can; anything still ``auto`` is a RuntimeConfigError naming the key. The
rest of the runtime reads only this object, never the config model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from zerorun.errors import RuntimeConfigError
from zerorun.runtime.precision import LossScaler, MixedPrecisionPolicy

__all__ = ["RuntimeSettings", "resolve_batch", "settings_from_config"]

_COMM_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class RuntimeSettings:
    stage: int = 0
    micro_batch: int = 1
    grad_accum: int = 1
    train_batch: int = 1
    policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    fp16: bool = False
    loss_scale: float = 0.0  # 0: dynamic
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    gradient_clipping: float = 0.0
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    optimizer_type: str | None = None
    optimizer_params: dict[str, Any] = field(default_factory=dict)
    scheduler_type: str | None = None
    scheduler_params: dict[str, Any] = field(default_factory=dict)
    allow_untested_optimizer: bool = False
    steps_per_print: int = 10
    offload_optimizer_device: str = "none"
    offload_param_device: str = "none"
    dataloader_drop_last: bool = False
    zero: Any = None  # the zero_optimization section, for stage 3 / offload modules
    zerorun: Any = None  # zerorun's own `zerorun:` section (stage-3 grouping, order check, ...)

    def make_scaler(self) -> LossScaler:
        if not self.fp16:
            return LossScaler.disabled()
        if self.loss_scale > 0:
            return LossScaler(dynamic=False, init_scale=self.loss_scale)
        return LossScaler(
            dynamic=True,
            init_scale=2.0**self.initial_scale_power,
            window=self.loss_scale_window,
            hysteresis=self.hysteresis,
            min_scale=self.min_loss_scale,
            consecutive_hysteresis=self.consecutive_hysteresis,
        )


def _get(obj: Any, dotted: str, default: Any = None) -> Any:
    for part in dotted.split("."):
        if obj is None:
            return default
        obj = obj.get(part, None) if isinstance(obj, dict) else getattr(obj, part, None)
    return default if obj is None else obj


def _concrete(value: Any, key: str, how: str) -> Any:
    if value == "auto":
        raise RuntimeConfigError(f"{key} is 'auto' and zerorun.initialize cannot fill it: {how}")
    return value


def resolve_batch(
    train_batch: int | None, micro: int | None, accum: int | None, world: int
) -> tuple[int, int, int]:
    """DeepSpeed's batch triad, train_batch = micro * accum * world, for the concrete values
    ``initialize`` has (None: not given or ``auto``). The rule is ``zerorun.config``'s (one
    rule, one place: config/batch.py); here a contradiction or a batch size still unknown is a
    RuntimeConfigError naming the keys. Returns (train_batch, micro, accum)."""
    # Imported here: zerorun.config loads the YAML reader, which the runtime's modules do not
    # import at module level (initialize loads the config through it anyway).
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


def _opt_int(value: Any) -> int | None:
    return None if value is None or value == "auto" else int(value)


def settings_from_config(
    cfg: Any, *, world_size: int, micro_batch_hint: int | None = None
) -> RuntimeSettings:
    """Contract-1 config model (or an equivalent object/dict) -> RuntimeSettings."""
    micro = _opt_int(_get(cfg, "train_micro_batch_size_per_gpu"))
    if micro is None and micro_batch_hint is not None:
        micro = micro_batch_hint
    train_batch, micro, accum = resolve_batch(
        _opt_int(_get(cfg, "train_batch_size")),
        micro,
        _opt_int(_get(cfg, "gradient_accumulation_steps")),
        world_size,
    )
    fp16 = _concrete(_get(cfg, "fp16.enabled", False), "fp16.enabled", "set true or false")
    bf16 = _concrete(_get(cfg, "bf16.enabled", False), "bf16.enabled", "set true or false")
    if fp16 and bf16:
        raise RuntimeConfigError("fp16.enabled and bf16.enabled are both true: choose one")
    param_dtype = torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32
    comm = _get(cfg, "communication_data_type")
    reduce_dtype = torch.float32
    if comm is not None:
        if comm not in _COMM_DTYPES:
            raise RuntimeConfigError(f"communication_data_type {comm!r}: use fp32, bf16 or fp16")
        reduce_dtype = _COMM_DTYPES[comm]
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, master_dtype=torch.float32
    )
    clip = _concrete(
        _get(cfg, "gradient_clipping", 0.0), "gradient_clipping", "set a number (0 disables clipping)"
    )
    zero = _get(cfg, "zero_optimization")
    stage = int(_get(zero, "stage", 0))
    reduce_bucket = _concrete(
        _get(zero, "reduce_bucket_size", 500_000_000),
        "zero_optimization.reduce_bucket_size",
        "set a number of elements",
    )
    optimizer = _get(cfg, "optimizer")
    scheduler = _get(cfg, "scheduler")
    return RuntimeSettings(
        stage=stage,
        micro_batch=micro,
        grad_accum=accum,
        train_batch=train_batch,
        policy=policy,
        fp16=bool(fp16),
        loss_scale=float(_get(cfg, "fp16.loss_scale", 0.0)),
        initial_scale_power=int(_get(cfg, "fp16.initial_scale_power", 16)),
        loss_scale_window=int(_get(cfg, "fp16.loss_scale_window", 1000)),
        hysteresis=int(_get(cfg, "fp16.hysteresis", 2)),
        consecutive_hysteresis=bool(_get(cfg, "fp16.consecutive_hysteresis", False)),
        min_loss_scale=float(_get(cfg, "fp16.min_loss_scale", 1.0)),
        gradient_clipping=float(clip),
        reduce_bucket_size=int(reduce_bucket),
        allgather_bucket_size=int(_get(zero, "allgather_bucket_size", 500_000_000)),
        optimizer_type=_get(optimizer, "type"),
        optimizer_params=dict(_get(optimizer, "params", {}) or {}),
        scheduler_type=_get(scheduler, "type"),
        scheduler_params=dict(_get(scheduler, "params", {}) or {}),
        allow_untested_optimizer=bool(_get(cfg, "zero_allow_untested_optimizer", False)),
        steps_per_print=int(_get(cfg, "steps_per_print", 10)),
        offload_optimizer_device=str(_get(zero, "offload_optimizer.device", "none")),
        offload_param_device=str(_get(zero, "offload_param.device", "none")),
        dataloader_drop_last=bool(_get(cfg, "dataloader_drop_last", False)),
        zero=zero,
        zerorun=_get(cfg, "zerorun"),
    )
