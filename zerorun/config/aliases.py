"""DeepSpeed's old and alternative spellings, rewritten to the current keys before validation.

Deprecated spellings (`cpu_offload`, `bfloat16`, `stage3_gather_fp16_weights_on_model_save`,
`zero_optimization: true`, ...) keep working with a warning that shows the modern form.
DeepSpeed's internal names for the stage-3 keys (`prefetch_bucket_size` for
`stage3_prefetch_bucket_size`) are accepted as DeepSpeed accepts them, without a warning.
Giving both spellings of one key is an error: which one wins would be a guess.
"""

from __future__ import annotations

from typing import Any

from zerorun.config.jsonc import Path_
from zerorun.config.reader import RawConfig
from zerorun.errors import ConfigError

__all__ = ["rewrite_aliases", "STAGE3_SHORT_NAMES"]

# DeepSpeed's pydantic field name -> its JSON alias (both accepted by DeepSpeed).
STAGE3_SHORT_NAMES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
    "partition_stream_chunk_size": "stage3_partition_stream_chunk_size",
}


_SECTIONS_WITH_DEFAULTS = frozenset(
    {
        "fp16", "bf16", "amp", "zero_optimization", "flops_profiler", "activation_checkpointing", "aio",
        "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "checkpoint", "data_types",
        "eigenvalue", "progressive_layer_drop", "launcher", "zerorun",
    }
)  # fmt: skip


def _rename(raw: RawConfig, section: dict[str, Any], prefix: Path_, old: str, new: str) -> None:
    if new in section:
        raise ConfigError(
            f"{raw.name}: {raw.where((*prefix, old))} and {raw.where((*prefix, new))} are two spellings of "
            f"the same key; keep only {new!r}"
        )
    section[new] = section.pop(old)
    loc = raw.locations.get((*prefix, old))
    if loc is not None:
        raw.locations[(*prefix, new)] = loc


def rewrite_aliases(raw: RawConfig) -> list[str]:
    """Rewrite old spellings in `raw.data` in place; returns the deprecation warnings."""
    data = raw.data
    warnings: list[str] = []

    if "bfloat16" in data:
        warnings.append(f"{raw.where(('bfloat16',))} is DeepSpeed's old name of the section; using it as 'bf16'")
        _rename(raw, data, (), "bfloat16", "bf16")

    # `"fp16": null` and friends: DeepSpeed reads a null section as absent.
    for name in list(data):
        if data[name] is None and name in _SECTIONS_WITH_DEFAULTS:
            del data[name]

    zero = data.get("zero_optimization")
    if isinstance(zero, bool):
        # DeepSpeed's oldest format: `"zero_optimization": true` meant stage 1.
        stage = 1 if zero else 0
        new_zero: dict[str, Any] = {"stage": stage}
        if "allgather_size" in data:
            new_zero["allgather_bucket_size"] = data.pop("allgather_size")
        data["zero_optimization"] = zero = new_zero
        warnings.append(
            f"{raw.where(('zero_optimization',))}: a boolean is DeepSpeed's deprecated format; using stage {stage}. "
            f'Write "zero_optimization": {{"stage": {stage}}}'
        )
    if not isinstance(zero, dict):
        return warnings
    z: Path_ = ("zero_optimization",)

    for short, full in STAGE3_SHORT_NAMES.items():
        if short in zero:
            _rename(raw, zero, z, short, full)

    if "stage3_gather_fp16_weights_on_model_save" in zero:
        warnings.append(
            f"{raw.where((*z, 'stage3_gather_fp16_weights_on_model_save'))} is deprecated; "
            "using it as stage3_gather_16bit_weights_on_model_save"
        )
        _rename(raw, zero, z, "stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save")

    # `offload_*: null` is DeepSpeed's "no offload".
    for name in ("offload_optimizer", "offload_param"):
        if name in zero and zero[name] is None:
            del zero[name]

    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old not in zero:
            continue
        value = zero.pop(old)
        where = raw.where((*z, old))
        if not isinstance(value, bool):
            raise ConfigError(f"{raw.name}: {where} must be true or false, got {value!r}; better, use {new}")
        if value:
            if new in zero:
                raise ConfigError(
                    f"{raw.name}: {where} and {raw.where((*z, new))} both configure offload; keep only {new}"
                )
            zero[new] = {"device": "cpu"}
            warnings.append(f'{where} is deprecated; using {new}.device: "cpu". Write "{new}": {{"device": "cpu"}}')
        else:
            warnings.append(f"{where} is deprecated (false: no offload); remove it")

    if "cpu_offload_use_pin_memory" in zero:
        value = zero.pop("cpu_offload_use_pin_memory")
        where = raw.where((*z, "cpu_offload_use_pin_memory"))
        if not isinstance(value, bool):
            raise ConfigError(f"{raw.name}: {where} must be true or false, got {value!r}")
        for name in ("offload_optimizer", "offload_param"):
            section = zero.get(name)
            if isinstance(section, dict):
                section.setdefault("pin_memory", value)
        warnings.append(f"{where} is deprecated; write pin_memory inside offload_optimizer / offload_param")

    opt = zero.get("offload_optimizer")
    if isinstance(opt, dict) and "pipeline" in opt:
        value = opt.pop("pipeline")
        where = raw.where((*z, "offload_optimizer", "pipeline"))
        opt.setdefault("pipeline_read", value)
        opt.setdefault("pipeline_write", value)
        warnings.append(f"{where} is deprecated; using pipeline_read and pipeline_write")
    return warnings
