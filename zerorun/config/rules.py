"""Rules between keys, checked after each key is valid on its own.

Errors are contradictions no run can satisfy. Warnings are settings that have no effect where
they are (DeepSpeed ignores them too, so an error would break configs that work there).
Notices are DeepSpeed features zerorun accepts but does not implement.

The offload rules (stage, Twin-Flow ratio, ZenFlow, NVMe) are config/offload_rules.py; the check of
the optimizer / scheduler the runtime builds is config/runtime_support.py. check_rules is the one
entry point and runs them all.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel

from zerorun.config.jsonc import Path_
from zerorun.config.observe_sections import observe_rules
from zerorun.config.offload_rules import (
    ZENFLOW_AUTO_UPDATE_INTERVAL,
    delayed_update_in_effect,
    offload_in_effect,
    offload_rules,
    offload_stage_warnings,
    zenflow_intervals,
)
from zerorun.config.reader import RawConfig, dotted
from zerorun.config.runtime_support import check_runtime_support
from zerorun.config.schema import ZerorunConfig
from zerorun.config.types import AUTO, field_meta, shown

__all__ = [
    "check_rules",
    "check_runtime_support",
    "checkpoint_dir_problems",
    "open_autos",
    "set_keys",
    "offload_in_effect",
    "delayed_update_in_effect",
    "zenflow_intervals",
    "ZENFLOW_AUTO_UPDATE_INTERVAL",
    "RESUME_ENV",
]


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
        extra = field_meta(type(holder), name)
        if extra.get("acted_on", True):
            continue
        value = getattr(holder, name)
        if "fixed" in extra:
            same = value == extra["fixed_value"] if "fixed_value" in extra else _is_default(holder, name)
            if not same:
                text = f"{raw.where(path)} = {shown(value)}: no effect; {extra['fixed']}"
                notices.append((raw.locations.get(path, (10**9, 0)), text))
            continue
        if _is_default(holder, name) or value is None or _section_is_off(value):
            continue
        if isinstance(value, BaseModel | dict):
            text = f"{raw.where(path)}: DeepSpeed section accepted; zerorun does not act on it"
        else:
            text = f"{raw.where(path)} = {shown(value)}: DeepSpeed key accepted; zerorun does not act on it"
        notices.append((raw.locations.get(path, (10**9, 0)), text))
    return [text for _, text in sorted(notices)]


_ACCEPTED_SECTIONS = {
    name
    for name, info in ZerorunConfig.model_fields.items()
    if isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get("acted_on") is False
}


def _stage_warnings(raw: RawConfig, config: ZerorunConfig) -> list[str]:
    zero = config.zero_optimization
    stage = zero.stage
    warnings: list[str] = []
    misplaced: dict[tuple[int, ...], list[Path_]] = {}
    # Any key with `stages` metadata (zero_optimization's, and the zerorun: section's stage3_*);
    # the offload sections have rules of their own (offload_rules.offload_stage_warnings).
    for path, holder, name in set_keys(config):
        if name in ("offload_optimizer", "offload_param"):
            continue
        stages = field_meta(type(holder), name).get("stages")
        if stages is not None and stage not in stages:
            misplaced.setdefault(tuple(stages), []).append(path)
    for stages, paths in sorted(misplaced.items()):
        paths.sort(key=lambda p: raw.locations.get(p, (0, 0)))
        where = ", ".join(raw.where(p) for p in paths)
        at = "stage 3" if stages == (3,) else "stages " + "/".join(str(s) for s in stages)
        verb = "applies" if len(paths) == 1 else "apply"
        warnings.append(f"{where}: {verb} at {at} only; ignored at stage {stage}")

    return warnings


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
                f"{raw.where(('amp', 'enabled'))} = {shown(amp_on)} together with {others[0]}.enabled: two mixed-precision "
                f"systems at once cause dtype mismatches ('expected scalar type Half but found Float'). zerorun "
                f"ignores amp and uses {others[0]}; remove the amp section"
            )
        else:
            warnings.append(
                f"{raw.where(('amp', 'enabled'))} = {shown(amp_on)}: zerorun does not use NVIDIA apex AMP, so this "
                'trains in fp32; use "bf16": {"enabled": true} or "fp16": {"enabled": true} instead'
            )
    return errors, warnings

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
    if launcher.launcher == "sim":
        # Meant for trying the launcher at scale; left in a real job's config it would quietly
        # train nothing, so say so wherever the config is read (print-config, the launch).
        warnings.append(
            f"{raw.where(('launcher', 'launcher'))} = 'sim': the hostfile's nodes are simulated on this "
            "machine and the script does not run (unless the command line's --launcher says otherwise)"
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
    for rule in (_precision_rules, offload_rules, _launcher_rules, observe_rules):
        e, w = rule(raw, config)
        errors += e
        warnings += w
    errors += _checkpoint_rules(raw, config, resume_from)
    warnings += _stage_warnings(raw, config) + offload_stage_warnings(raw, config)
    return errors, warnings, _notices(raw, config)
