"""What zerorun's runtime builds from `optimizer:` and `scheduler:`, known without importing torch.

The runtime (runtime/optimizer.py `ELEMENTWISE`, runtime/scheduler.py `SCHEDULERS`) fails at
`zerorun.initialize` -- on every rank, after the launch -- for an optimizer or scheduler it does
not build, or for a keyword its constructor does not take. Checking the config against these
tables (check_runtime_support, below; run by the loader) catches that before a single rank
starts. tests/config/test_runtime_support.py keeps them in step with the runtime and with torch's signatures.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from zerorun.config.reader import RawConfig
from zerorun.config.types import AUTO

if TYPE_CHECKING:
    from zerorun.config.schema import ZerorunConfig

__all__ = ["OPTIMIZER_KWARGS", "SCHEDULER_KWARGS", "DEEPSPEED_ADAM_EXTRAS", "SCHEDULER_REQUIRED", "check_runtime_support"]

_COMMON = frozenset({"lr", "weight_decay", "foreach", "maximize", "differentiable"})

# Canonical optimizer name -> constructor keywords (torch.optim, torch 2.x; a superset across versions).
OPTIMIZER_KWARGS: dict[str, frozenset[str]] = {
    "Adam": _COMMON | {"betas", "eps", "amsgrad", "capturable", "fused", "decoupled_weight_decay"},
    "AdamW": _COMMON | {"betas", "eps", "amsgrad", "capturable", "fused"},
    "SGD": _COMMON | {"momentum", "dampening", "nesterov", "fused"},
    "Adagrad": _COMMON | {"lr_decay", "initial_accumulator_value", "eps", "fused"},
    "RMSprop": _COMMON | {"alpha", "eps", "momentum", "centered", "capturable"},
    "Adamax": _COMMON | {"betas", "eps", "capturable"},
    "NAdam": _COMMON | {"betas", "eps", "momentum_decay", "decoupled_weight_decay", "capturable"},
    "RAdam": _COMMON | {"betas", "eps", "decoupled_weight_decay", "capturable"},
    "Adadelta": _COMMON | {"rho", "eps", "capturable"},
}

# DeepSpeed's Adam/AdamW keys the runtime understands: `adam_w_mode` picks AdamW (default) or
# Adam; `torch_adam` chooses an implementation and changes nothing here.
DEEPSPEED_ADAM_EXTRAS = frozenset({"adam_w_mode", "torch_adam"})

# Scheduler name -> keywords (DeepSpeed's names and meanings).
_WARMUP = frozenset({"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"})
SCHEDULER_KWARGS: dict[str, frozenset[str]] = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": _WARMUP | {"total_num_steps"},
    "WarmupCosineLR": frozenset(
        {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type", "last_batch_iteration"}
    ),
}

# Keywords a scheduler cannot do without (DeepSpeed's constructors have no default for them).
SCHEDULER_REQUIRED: dict[str, frozenset[str]] = {
    "WarmupDecayLR": frozenset({"total_num_steps"}),
    "WarmupCosineLR": frozenset({"total_num_steps"}),
}


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
