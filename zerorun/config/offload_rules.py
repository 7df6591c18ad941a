"""The offload rules between keys: where optimizer / parameter offload acts (by stage), the
delayed parameter update, Twin-Flow's ``offload_optimizer.ratio`` (and zerorun's ``"auto"`` with
``zerorun.offload_gpu_budget_gb``), ZenFlow, and NVMe paths. The one place these rules live:
config/rules.py's ``check_rules`` calls them, the runtime's settings and the estimator read
``offload_in_effect`` / ``delayed_update_in_effect`` / ``zenflow_intervals`` from here.
"""

from __future__ import annotations

import os
from typing import Any

from zerorun.config.reader import RawConfig, dotted
from zerorun.config.schema import ZerorunConfig
from zerorun.config.types import AUTO, field_meta, shown
from zerorun.config.zero_section import OffloadDevice, ZeroOptimization

__all__ = [
    "ZENFLOW_AUTO_UPDATE_INTERVAL",
    "delayed_update_in_effect",
    "offload_in_effect",
    "offload_rules",
    "offload_stage_warnings",
    "zenflow_intervals",
]

def offload_in_effect(
    stage: int, optimizer_device: OffloadDevice, param_device: OffloadDevice
) -> tuple[OffloadDevice, OffloadDevice]:
    """(optimizer, parameter) offload devices as they act at ``stage``: optimizer offload needs
    stage 1-3, parameter offload stage 3 (the schema's ``stages=`` of ``offload_optimizer`` /
    ``offload_param``; DeepSpeed's rule too); ``none`` elsewhere. The one statement of the rule:
    the loader's warnings, the runtime's settings and the estimator all go through it."""
    opt_stages = field_meta(ZeroOptimization, "offload_optimizer").get("stages", ())
    param_stages = field_meta(ZeroOptimization, "offload_param").get("stages", ())
    return (
        optimizer_device if stage in opt_stages else "none",
        param_device if stage in param_stages else "none",
    )


def delayed_update_in_effect(config: ZerorunConfig) -> bool:
    """``zerorun.delayed_param_update`` acts only with optimizer offload in effect (it delays
    the CPU step; without one there is nothing to delay)."""
    zero = config.zero_optimization
    opt_dev, _ = offload_in_effect(zero.stage, zero.offload_optimizer.device, zero.offload_param.device)
    return config.zerorun.delayed_param_update and opt_dev != "none"


def offload_stage_warnings(raw: RawConfig, config: ZerorunConfig) -> list[str]:
    """Offload keys set where they have no effect (the stage, or no optimizer offload)."""
    zero = config.zero_optimization
    stage = zero.stage
    warnings: list[str] = []
    param_dev = zero.offload_param.device
    opt_dev = zero.offload_optimizer.device
    opt_acts, param_acts = offload_in_effect(stage, opt_dev, param_dev)
    if param_dev != param_acts:
        warnings.append(
            f"{raw.where(('zero_optimization', 'offload_param', 'device'))} = {param_dev!r}: parameter offload "
            f"needs zero_optimization.stage 3 (you have {stage}); it has no effect here"
        )
    if opt_dev != opt_acts:
        warnings.append(
            f"{raw.where(('zero_optimization', 'offload_optimizer', 'device'))} = {opt_dev!r}: optimizer offload "
            "needs zero_optimization.stage 1, 2 or 3 (you have 0); it has no effect here"
        )
    if config.zerorun.delayed_param_update and not delayed_update_in_effect(config):
        warnings.append(
            f"{raw.where(('zerorun', 'delayed_param_update'))}: the delayed parameter update overlaps the CPU "
            "optimizer step with the next forward/backward, so it needs zero_optimization.offload_optimizer.device "
            "cpu or nvme at stage 1-3; it has no effect here"
        )
    return warnings


def offload_rules(raw: RawConfig, config: ZerorunConfig) -> tuple[list[str], list[str]]:
    errors: list[str] = []
    warnings: list[str] = []
    zero = config.zero_optimization
    acting = offload_in_effect(zero.stage, zero.offload_optimizer.device, zero.offload_param.device)
    if acting[0] != "none" and zero.sub_group_size < 1:
        errors.append(
            f"{raw.where(('zero_optimization', 'sub_group_size'))} = {zero.sub_group_size}: the optimizer step "
            "with offload_optimizer runs in tiles of this many elements; give at least 1"
        )
    for rule in (_ratio_rules, _zenflow_rules):
        more_errors, more_warnings = rule(raw, config, acting[0])
        errors += more_errors
        warnings += more_warnings
    for name, device in zip(("offload_optimizer", "offload_param"), acting, strict=True):
        section = getattr(zero, name)
        if device != "nvme":
            continue
        path = ("zero_optimization", name)
        if not section.nvme_path:
            errors.append(
                f"{raw.where((*path, 'device'))} = 'nvme' needs {dotted((*path, 'nvme_path'))}: a directory on a "
                "fast local disk of every node, e.g. /local_nvme"
            )
        elif not os.path.isdir(section.nvme_path):
            warnings.append(
                f"{raw.where((*path, 'nvme_path'))} = {section.nvme_path!r} does not exist on this machine "
                "(fine if it exists on the training nodes)"
            )
    return errors, warnings


def _ratio_rules(raw: RawConfig, config: ZerorunConfig, opt_dev: str) -> tuple[list[str], list[str]]:
    """``offload_optimizer.ratio`` (Twin-Flow) and its zerorun extension ``"auto"`` with
    ``zerorun.offload_gpu_budget_gb`` (docs/offload.md)."""
    errors: list[str] = []
    warnings: list[str] = []
    zero = config.zero_optimization
    ratio = zero.offload_optimizer.ratio
    budget = config.zerorun.offload_gpu_budget_gb
    where = raw.where(("zero_optimization", "offload_optimizer", "ratio"))
    budget_where = raw.where(("zerorun", "offload_gpu_budget_gb"))
    partial = ratio == AUTO or ratio < 1.0
    if partial and opt_dev == "nvme":
        errors.append(
            f"{where} = {shown(ratio)}: partial optimizer offload keeps part of the states on the GPU and the rest "
            "in host memory; it works with offload_optimizer.device 'cpu', not 'nvme' (remove ratio, or use cpu)"
        )
    if partial and opt_dev != "none" and config.zerorun.delayed_param_update:
        errors.append(
            f"{where} = {shown(ratio)} with {raw.where(('zerorun', 'delayed_param_update'))}: the delayed update "
            "is not built for a partial offload (the GPU part would step without the delay); use one of the two"
        )
    if partial and opt_dev == "none" and zero.offload_optimizer.device == "none":
        warnings.append(f"{where} = {shown(ratio)}: no effect without offload_optimizer.device 'cpu'")
    if ratio == AUTO:
        if budget <= 0:
            errors.append(
                f"{where} = \"auto\" needs {budget_where}: the GPU memory per rank (GB) the optimizer's fp32 "
                "masters and states may take; zerorun keeps that much on the GPU and offloads the rest"
            )
        elif opt_dev == "cpu":
            warnings.append(
                f"{where} = \"auto\" is a zerorun extension (DeepSpeed wants a number): the largest GPU share of "
                f"the optimizer states that fits {budget_where} = {budget:g} GB per rank"
            )
    elif budget > 0:
        warnings.append(f"{budget_where} = {budget:g}: no effect unless offload_optimizer.ratio is \"auto\"")
    return errors, warnings


# zerorun's value for update_interval "auto" (DeepSpeed adapts it while training, from auto_ratio;
# not built): DeepSpeed's documented example value.
ZENFLOW_AUTO_UPDATE_INTERVAL = 4


def zenflow_intervals(zf: Any) -> tuple[int, int]:
    """(select_interval, update_interval) in optimizer steps, as zerorun runs ZenFlow: strategy
    ``step`` takes select_interval as is; ``epoch`` (and ``auto``: one epoch) multiplies it by
    ``steps_per_epoch``, and without it selects once (0), as DeepSpeed does without a data
    loader; update_interval ``"auto"`` is ZENFLOW_AUTO_UPDATE_INTERVAL."""
    update = ZENFLOW_AUTO_UPDATE_INTERVAL if zf.update_interval == AUTO else int(zf.update_interval)
    if zf.select_strategy == "step":
        return int(zf.select_interval), update
    epochs = 1 if zf.select_strategy == AUTO or zf.select_interval == AUTO else int(zf.select_interval)
    return (epochs * zf.steps_per_epoch if zf.steps_per_epoch else 0), update


def _zenflow_rules(raw: RawConfig, config: ZerorunConfig, opt_dev: str) -> tuple[list[str], list[str]]:
    """DeepSpeed's cross-key rules of ``zero_optimization.zenflow`` (its configure_zenflow)."""
    errors: list[str] = []
    warnings: list[str] = []
    zf = config.zero_optimization.zenflow
    if zf is None:
        return errors, warnings
    path = ("zero_optimization", "zenflow")
    select = raw.where((*path, "select_interval"))
    if zf.select_strategy == AUTO:
        if zf.select_interval != AUTO:
            warnings.append(
                f"{select} = {zf.select_interval}: ignored with select_strategy \"auto\" (columns are re-selected "
                "every epoch); set select_strategy \"step\" or \"epoch\" to use it"
            )
    elif zf.select_interval == AUTO:
        errors.append(
            f"{raw.where((*path, 'select_strategy'))} = {zf.select_strategy!r} needs a number in {select} "
            f"(how many {zf.select_strategy}s between re-selections of the important columns)"
        )
    elif (
        zf.select_strategy == "step" and zf.update_interval != AUTO and zf.select_interval < zf.update_interval
    ):
        errors.append(
            f"{select} = {zf.select_interval} is below {raw.where((*path, 'update_interval'))} = "
            f"{zf.update_interval}: columns must stay selected at least one update interval"
        )
    if opt_dev != "cpu":
        warnings.append(
            f"{raw.where(path)}: ZenFlow is a mode of CPU optimizer offload; it needs "
            "zero_optimization.offload_optimizer.device 'cpu' at stage 1-3 (no effect here)"
        )
        return errors, warnings
    zero = config.zero_optimization
    if zero.offload_optimizer.ratio == AUTO or zero.offload_optimizer.ratio < 1.0:
        errors.append(f"{raw.where(path)} with offload_optimizer.ratio < 1: use one of the two")
    if config.zerorun.delayed_param_update:
        errors.append(f"{raw.where(path)} with zerorun.delayed_param_update: use one of the two")
    if zero.stage == 3 and zero.offload_param.device != "none":
        errors.append(
            f"{raw.where(path)} with offload_param: ZenFlow writes its important columns into the parameter "
            "shards on the GPU; remove offload_param"
        )
    if zf.update_interval == AUTO:
        warnings.append(
            f"{raw.where((*path, 'update_interval'))} = \"auto\": DeepSpeed's adaptive interval is not built; "
            f"zerorun uses {ZENFLOW_AUTO_UPDATE_INTERVAL} (set a number to choose)"
        )
    if zf.select_strategy != "step" and not zf.steps_per_epoch:
        warnings.append(
            f"{raw.where((*path, 'select_strategy'))} = {zf.select_strategy!r} re-selects every epoch, but the steps "
            "per epoch are unknown: the important columns are selected once (set steps_per_epoch, or "
            "select_strategy \"step\" with a select_interval)"
        )
    return errors, warnings
