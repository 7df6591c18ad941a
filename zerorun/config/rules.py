"""Rules between keys, checked after each key is valid on its own.

Errors are contradictions no run can satisfy. Warnings are settings that have no effect where
they are (DeepSpeed ignores them too, so an error would break configs that work there).
Notices are DeepSpeed features zerorun accepts but does not implement.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pydantic import BaseModel

from zerorun.config.jsonc import Path_
from zerorun.config.observe_sections import observe_rules
from zerorun.config.reader import RawConfig, dotted
from zerorun.config.runtime_support import (
    DEEPSPEED_ADAM_EXTRAS,
    OPTIMIZER_KWARGS,
    SCHEDULER_KWARGS,
    SCHEDULER_REQUIRED,
)
from zerorun.config.schema import ZerorunConfig
from zerorun.config.types import AUTO
from zerorun.config.zero_section import OffloadDevice, ZeroOptimization

__all__ = [
    "check_rules",
    "check_runtime_support",
    "open_autos",
    "set_keys",
    "offload_in_effect",
    "delayed_update_in_effect",
]


def _extra(model: type[BaseModel], name: str) -> dict[str, Any]:
    extra = model.model_fields[name].json_schema_extra
    return extra if isinstance(extra, dict) else {}


def set_keys(model: BaseModel, prefix: Path_ = ()) -> Iterator[tuple[Path_, BaseModel, str]]:
    """Every key the user wrote (recursively): (path, the model holding it, field name)."""
    for name in model.model_fields_set:
        if name not in type(model).model_fields:
            continue  # an `extra="allow"` key (amp's apex options)
        yield (*prefix, name), model, name
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from set_keys(value, (*prefix, name))


def open_autos(config: ZerorunConfig) -> list[str]:
    """Dotted paths of every `"auto"` left for the training script / integration to fill."""
    out: list[str] = []

    def visit(value: Any, path: Path_) -> None:
        if isinstance(value, str) and value == AUTO:
            out.append(dotted(path))
        elif isinstance(value, dict):
            for k, v in value.items():
                visit(v, (*path, k))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                visit(v, (*path, i))

    visit(config.to_dict(only_set=True), ())
    # Resolved by zerorun itself (offload_gpu_budget_gb) or by DeepSpeed's ZenFlow rules, not by
    # the script or an integration.
    return [
        p for p in out if p != "zero_optimization.offload_optimizer.ratio" and not p.startswith("zero_optimization.zenflow.")
    ]


def _is_default(model: BaseModel, name: str) -> bool:
    info = type(model).model_fields[name]
    value = getattr(model, name)
    default = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel) and isinstance(default, BaseModel):
        return value.model_dump() == default.model_dump()
    return bool(value == default)


def _section_is_off(value: Any) -> bool:
    enabled = value.get("enabled") if isinstance(value, dict) else getattr(value, "enabled", None)
    return enabled is False


def _notices(raw: RawConfig, config: ZerorunConfig) -> list[str]:
    notices: list[tuple[tuple[int, int], str]] = []
    for path, holder, name in set_keys(config):
        if path == ("checkpoint", "writer") and getattr(holder, name) is not None:
            text = (
                f"{raw.where(path)}: DeepSpeed's checkpoint writer has no effect; zerorun's asynchronous saves are "
                "zerorun.checkpoint.async (with every_n_steps; docs/fault-tolerance.md)"
            )
            notices.append((raw.locations.get(path, (10**9, 0)), text))
        if path == ("amp",) or len(path) > 1 and path[0] in _ACCEPTED_SECTIONS:
            continue  # amp gets a warning of its own; keys inside an accepted section: one notice per section
        extra = _extra(type(holder), name)
        if extra.get("acted_on", True):
            continue
        value = getattr(holder, name)
        if "fixed" in extra:
            same = value == extra["fixed_value"] if "fixed_value" in extra else _is_default(holder, name)
            if not same:
                text = f"{raw.where(path)} = {_show(value)}: no effect; {extra['fixed']}"
                notices.append((raw.locations.get(path, (10**9, 0)), text))
            continue
        if _is_default(holder, name) or value is None or _section_is_off(value):
            continue
        if isinstance(value, BaseModel | dict):
            text = f"{raw.where(path)}: DeepSpeed section accepted; zerorun does not act on it"
        else:
            text = f"{raw.where(path)} = {_show(value)}: DeepSpeed key accepted; zerorun does not act on it"
        notices.append((raw.locations.get(path, (10**9, 0)), text))
    return [text for _, text in sorted(notices)]


_ACCEPTED_SECTIONS = {
    name
    for name, info in ZerorunConfig.model_fields.items()
    if isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get("acted_on") is False
}


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


def offload_in_effect(
    stage: int, optimizer_device: OffloadDevice, param_device: OffloadDevice
) -> tuple[OffloadDevice, OffloadDevice]:
    """(optimizer, parameter) offload devices as they act at ``stage``: optimizer offload needs
    stage 1-3, parameter offload stage 3 (the schema's ``stages=`` of ``offload_optimizer`` /
    ``offload_param``; DeepSpeed's rule too); ``none`` elsewhere. The one statement of the rule:
    the loader's warnings, the runtime's settings and the estimator all go through it."""
    opt_stages = _extra(ZeroOptimization, "offload_optimizer").get("stages", ())
    param_stages = _extra(ZeroOptimization, "offload_param").get("stages", ())
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


def _stage_warnings(raw: RawConfig, config: ZerorunConfig) -> list[str]:
    zero = config.zero_optimization
    stage = zero.stage
    warnings: list[str] = []
    misplaced: dict[tuple[int, ...], list[Path_]] = {}
    # Any key with `stages` metadata (zero_optimization's, and the zerorun: section's stage3_*);
    # the offload sections have rules of their own below.
    for path, holder, name in set_keys(config):
        if name in ("offload_optimizer", "offload_param"):
            continue
        stages = _extra(type(holder), name).get("stages")
        if stages is not None and stage not in stages:
            misplaced.setdefault(tuple(stages), []).append(path)
    for stages, paths in sorted(misplaced.items()):
        paths.sort(key=lambda p: raw.locations.get(p, (0, 0)))
        where = ", ".join(raw.where(p) for p in paths)
        at = "stage 3" if stages == (3,) else "stages " + "/".join(str(s) for s in stages)
        verb = "applies" if len(paths) == 1 else "apply"
        warnings.append(f"{where}: {verb} at {at} only; ignored at stage {stage}")

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


def _offload_rules(raw: RawConfig, config: ZerorunConfig) -> tuple[list[str], list[str]]:
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
            f"{where} = {_show(ratio)}: partial optimizer offload keeps part of the states on the GPU and the rest "
            "in host memory; it works with offload_optimizer.device 'cpu', not 'nvme' (remove ratio, or use cpu)"
        )
    if partial and opt_dev != "none" and config.zerorun.delayed_param_update:
        errors.append(
            f"{where} = {_show(ratio)} with {raw.where(('zerorun', 'delayed_param_update'))}: the delayed update "
            "is not built for a partial offload (the GPU part would step without the delay); use one of the two"
        )
    if partial and opt_dev == "none" and zero.offload_optimizer.device == "none":
        warnings.append(f"{where} = {_show(ratio)}: no effect without offload_optimizer.device 'cpu'")
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


def _precision_rules(raw: RawConfig, config: ZerorunConfig) -> tuple[list[str], list[str]]:
    errors: list[str] = []
    warnings: list[str] = []
    if config.fp16.enabled is True and config.bf16.enabled is True:
        errors.append(
            f"{raw.where(('fp16', 'enabled'))} and {raw.where(('bf16', 'enabled'))} are both true; "
            "choose one (bf16 on GPUs that support it, such as A100/H100; fp16 otherwise)"
        )
    if config.communication_data_type == "fp16" and config.bf16.enabled is True:
        warnings.append(
            f"{raw.where(('communication_data_type',))} = 'fp16' with bf16 training: bf16 gradients can exceed "
            "fp16's range (max 65504) and overflow in the reduction; use 'bf16' or 'fp32'"
        )
    amp_on = config.amp.enabled
    if amp_on is True or amp_on == AUTO:
        others = [s for s in ("fp16", "bf16") if getattr(config, s).enabled in (True, AUTO)]
        if others:
            warnings.append(
                f"{raw.where(('amp', 'enabled'))} = {_show(amp_on)} together with {others[0]}.enabled: two mixed-precision "
                f"systems at once cause dtype mismatches ('expected scalar type Half but found Float'). zerorun "
                f"ignores amp and uses {others[0]}; remove the amp section"
            )
        else:
            warnings.append(
                f"{raw.where(('amp', 'enabled'))} = {_show(amp_on)}: zerorun does not use NVIDIA apex AMP, so this "
                'trains in fp32; use "bf16": {"enabled": true} or "fp16": {"enabled": true} instead'
            )
    return errors, warnings


def _suggest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def check_runtime_support(raw: RawConfig, config: ZerorunConfig) -> list[str]:
    """Optimizer / scheduler the runtime cannot build: valid DeepSpeed, but zerorun.initialize
    would fail on every rank after the launch."""
    errors: list[str] = []
    opt = config.optimizer
    if opt is not None:
        name = opt.canonical_type
        if name not in OPTIMIZER_KWARGS:
            errors.append(
                f"{raw.where(('optimizer', 'type'))} = {opt.type!r}: zerorun does not build this optimizer; it builds "
                f"{', '.join(OPTIMIZER_KWARGS)} (elementwise optimizers, which ZeRO's slicing leaves exact). "
                "Use one of those, or build your own torch optimizer and pass it to zerorun.initialize"
            )
        else:
            allowed = OPTIMIZER_KWARGS[name] | (DEEPSPEED_ADAM_EXTRAS if name in ("Adam", "AdamW") else frozenset())
            for key in opt.params:
                if key not in allowed:
                    errors.append(
                        f"{raw.where(('optimizer', 'params', key))}: not a parameter of {name}.{_suggest(key, allowed)} "
                        f"{name} takes: {', '.join(sorted(allowed))}"
                    )
            errors += _optimizer_values(raw, opt.params)
    sched = config.scheduler
    if sched is not None:
        if sched.type not in SCHEDULER_KWARGS:
            errors.append(
                f"{raw.where(('scheduler', 'type'))} = {sched.type!r}: zerorun does not build this scheduler; it builds "
                f"{', '.join(SCHEDULER_KWARGS)}. Use one of those, or pass lr_scheduler=callable(optimizer) to "
                "zerorun.initialize"
            )
        else:
            allowed = SCHEDULER_KWARGS[sched.type]
            for key in sched.params:
                if key not in allowed:
                    errors.append(
                        f"{raw.where(('scheduler', 'params', key))}: not a parameter of {sched.type}."
                        f"{_suggest(key, allowed)} {sched.type} takes: {', '.join(sorted(allowed))}"
                    )
            warmup_type = sched.params.get("warmup_type", "log")
            if warmup_type not in ("log", "linear", AUTO):
                errors.append(
                    f"{raw.where(('scheduler', 'params', 'warmup_type'))} = {warmup_type!r}: allowed: 'log', 'linear'"
                )
            missing = sorted(SCHEDULER_REQUIRED.get(sched.type, frozenset()) - set(sched.params))
            if missing:
                errors.append(f"{raw.where(('scheduler', 'params'))}: {sched.type} needs {', '.join(missing)}")
    return errors


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _optimizer_values(raw: RawConfig, params: dict[str, Any]) -> list[str]:
    """The values torch's optimizers check in their constructors (lr, eps, betas, ...)."""
    errors: list[str] = []
    for key in ("lr", "eps", "weight_decay", "momentum"):
        value = params.get(key)
        if value is None or value == AUTO:
            continue
        if not _is_number(value) or value < 0:
            errors.append(f"{raw.where(('optimizer', 'params', key))} = {value!r}: must be a number ≥ 0")
    betas = params.get("betas")
    if betas is not None and betas != AUTO:
        ok = isinstance(betas, list) and len(betas) == 2 and all(_is_number(b) and 0 <= b < 1 for b in betas)
        if not ok:
            errors.append(
                f"{raw.where(('optimizer', 'params', 'betas'))} = {betas!r}: must be two numbers in [0, 1), e.g. [0.9, 0.999]"
            )
    return errors


def _launcher_rules(raw: RawConfig, config: ZerorunConfig) -> tuple[list[str], list[str]]:
    errors: list[str] = []
    warnings: list[str] = []
    launcher = config.launcher
    if launcher.include and launcher.exclude:
        errors.append(
            f"{raw.where(('launcher', 'include'))} and {raw.where(('launcher', 'exclude'))} are mutually "
            "exclusive (as in DeepSpeed); keep one"
        )
    if launcher.hostfile:
        base = raw.path.parent if raw.path is not None else None
        hostfile = launcher.hostfile if base is None or os.path.isabs(launcher.hostfile) else str(base / launcher.hostfile)
        if not os.path.isfile(hostfile):
            warnings.append(
                f"{raw.where(('launcher', 'hostfile'))} = {launcher.hostfile!r}: no such file here ({hostfile})"
            )
    return errors, warnings


# The launcher's --resume_from as the ranks see it (Contract 2; runtime/checkpoint/options.py).
RESUME_ENV = "ZERORUN_RESUME_FROM"


def checkpoint_dir_problems(
    *,
    dir: str | None,
    resume_from: str | None,
    auto_resume: bool,
    every_n_steps: int,
    save_on_preemption: bool,
    where: Callable[[Path_], str] = dotted,
) -> list[str]:
    """What asks for a checkpoint directory when there is none (neither `zerorun.checkpoint.dir`
    nor a --resume_from / `launcher.resume_from`). The one source of this message: the config's
    rules, the launcher's check of its flags and the runtime's last check all call it."""
    if dir or resume_from:
        return []
    return [
        f"{where(path)}{suffix} needs a checkpoint directory: set zerorun.checkpoint.dir in the config "
        "(or launch with --resume_from DIR)"
        for path, suffix, needed in (
            (("zerorun", "checkpoint", "auto_resume"), "", auto_resume),
            (("zerorun", "checkpoint", "every_n_steps"), "", every_n_steps > 0),
            (("launcher", "save_on_preemption"), " (--save_on_preemption)", save_on_preemption),
        )
        if needed
    ]


def _checkpoint_rules(raw: RawConfig, config: ZerorunConfig, resume_from: str | None) -> list[str]:
    ckpt = config.zerorun.checkpoint
    return checkpoint_dir_problems(
        dir=ckpt.dir,
        resume_from=resume_from or config.launcher.resume_from or os.environ.get(RESUME_ENV),
        auto_resume=ckpt.auto_resume,
        every_n_steps=ckpt.every_n_steps,
        save_on_preemption=bool(config.launcher.save_on_preemption),
        where=raw.where,
    )


def check_rules(
    raw: RawConfig, config: ZerorunConfig, *, resume_from: str | None = None
) -> tuple[list[str], list[str], list[str]]:
    """-> (errors, warnings, notices) of the rules between keys. `resume_from`: the launcher's
    --resume_from (in a rank: its ZERORUN_RESUME_FROM), a checkpoint directory besides the config's."""
    errors: list[str] = []
    warnings: list[str] = []
    for rule in (_precision_rules, _offload_rules, _launcher_rules, observe_rules):
        e, w = rule(raw, config)
        errors += e
        warnings += w
    errors += _checkpoint_rules(raw, config, resume_from)
    warnings += _stage_warnings(raw, config)
    return errors, warnings, _notices(raw, config)
