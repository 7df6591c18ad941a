"""Schema of the DeepSpeed sections zerorun acts on besides ZeRO: precision, optimizer, scheduler."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import ConfigDict, field_validator

from zerorun.config.types import Auto, Count, Flag, Real, field, plain_numbers
from zerorun.config.zero_section import Section

__all__ = [
    "Fp16",
    "Bf16",
    "Amp",
    "OptimizerSection",
    "SchedulerSection",
    "OPTIMIZER_TYPES",
    "SCHEDULER_TYPES",
]

# Optimizer names DeepSpeed builds itself, and those it takes from torch.optim. DeepSpeed
# compares optimizer names case-insensitively; the value here is the canonical spelling.
OPTIMIZER_TYPES: dict[str, str] = {
    name.lower(): name
    for name in (
        # DeepSpeed's own
        "Adam", "AdamW", "Lamb", "OneBitAdam", "OneBitLamb", "ZeroOneAdam", "Muon", "Lion",
        "MuAdam", "MuAdamW", "MuSGD",
        # torch.optim
        "Adadelta", "Adafactor", "Adagrad", "Adamax", "ASGD", "LBFGS", "NAdam", "RAdam",
        "RMSprop", "Rprop", "SGD", "SparseAdam",
    )
}  # fmt: skip

# DeepSpeed's schedulers, then torch.optim.lr_scheduler's (DeepSpeed falls back to torch's).
SCHEDULER_TYPES: tuple[str, ...] = (
    "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
    "LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR",
    "ExponentialLR", "SequentialLR", "CosineAnnealingLR", "ChainedScheduler",
    "ReduceLROnPlateau", "CyclicLR", "CosineAnnealingWarmRestarts", "OneCycleLR", "PolynomialLR",
)  # fmt: skip


def _suggest(value: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def _suggest_optimizer(value: str) -> str:
    close = difflib.get_close_matches(value.lower(), list(OPTIMIZER_TYPES), n=1, cutoff=0.6)
    return f" Did you mean {OPTIMIZER_TYPES[close[0]]!r}?" if close else ""


class Fp16(Section):
    """`fp16`: 16-bit (half) mixed precision with dynamic loss scaling."""

    enabled: Flag | Auto = field(False, "Train in fp16 mixed precision (fp32 master weights, loss scaling).")
    loss_scale: Real = field(0.0, "Static loss scale; 0 means dynamic loss scaling.", ge=0)
    initial_scale_power: Count = field(16, "Dynamic scaling starts at 2**initial_scale_power.", ge=0, le=128)
    loss_scale_window: Count = field(1000, "Steps without overflow before the dynamic scale is raised.", ge=1)
    hysteresis: Count = field(2, "Overflows tolerated before the dynamic scale is lowered.", ge=1)
    consecutive_hysteresis: Flag = field(False, "Refill the hysteresis after every step without overflow.")
    min_loss_scale: Real = field(1.0, "Lower bound of the dynamic loss scale.", gt=0)
    auto_cast: Flag = field(False, "Cast the model's inputs to fp16 automatically.", acted_on=False)
    fused_mode: Flag = field(True, "DeepSpeed's fused fp16 optimizer.", acted_on=False)
    fp16_master_weights_and_grads: Flag = field(False, "Keep master weights and gradients in fp16.", acted_on=False)


class Bf16(Section):
    """`bf16` (old name `bfloat16`): bfloat16 mixed precision; no loss scaling needed."""

    enabled: Flag | Auto = field(False, "Train in bf16 mixed precision (fp32 master weights).")
    immediate_grad_update: Flag = field(True, "Apply bf16 gradient updates immediately.", acted_on=False)
    check_grad_overflow: Flag = field(False, "Check bf16 gradients for overflow.", acted_on=False)
    bf16_master_weights_and_grads: Flag = field(False, "Keep master weights and gradients in bf16.", acted_on=False)
    bf16_optimizer_states: Flag = field(False, "Keep optimizer states in bf16.", acted_on=False)


class Amp(Section):
    """`amp`: NVIDIA apex AMP. zerorun does not use apex; its fp16/bf16 sections do the job."""

    # apex.amp.initialize takes arbitrary keyword arguments (opt_level, loss_scale, ...).
    model_config = ConfigDict(extra="allow")

    enabled: Flag | Auto = field(False, "Use NVIDIA apex AMP (not supported by zerorun: use fp16 or bf16).")
    opt_level: str | None = field(None, "apex optimisation level (O0-O3).")


class OptimizerSection(Section):
    """`optimizer`: the optimizer zerorun builds (when the script does not pass its own)."""

    type: str = field(
        ...,
        "Optimizer name, case-insensitive. zerorun builds Adam, AdamW, SGD, Adagrad, RMSprop, Adamax, NAdam, RAdam, "
        "Adadelta (DeepSpeed's Adam means AdamW unless `adam_w_mode: false`); other DeepSpeed names are rejected.",
    )
    params: dict[str, Any] = field(
        default_factory=dict, description="Keyword arguments of the optimizer's constructor (lr, betas, eps, weight_decay, ...)."
    )
    legacy_fusion: Flag = field(False, "DeepSpeed's legacy fused optimizer.", acted_on=False)

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value.lower() not in OPTIMIZER_TYPES:
            known = sorted(OPTIMIZER_TYPES.values(), key=str.lower)
            raise ValueError(
                f"unknown optimizer {value!r}.{_suggest_optimizer(value)} "
                f"Known (case-insensitive): {', '.join(known)}"
            )
        return value

    @field_validator("params", mode="before")
    @classmethod
    def _numbers(cls, value: Any) -> Any:
        return plain_numbers(value)

    @property
    def canonical_type(self) -> str:
        """The optimizer name in its canonical spelling (`adamw` -> `AdamW`)."""
        return OPTIMIZER_TYPES[self.type.lower()]


class SchedulerSection(Section):
    """`scheduler`: the learning-rate schedule zerorun steps with the optimizer."""

    type: str = field(
        ..., "Scheduler name. zerorun builds WarmupLR, WarmupDecayLR and WarmupCosineLR (DeepSpeed's meanings)."
    )
    params: dict[str, Any] = field(default_factory=dict, description="Keyword arguments of the scheduler.")

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value not in SCHEDULER_TYPES:
            by_lower = {s.lower(): s for s in SCHEDULER_TYPES}
            if value.lower() in by_lower:
                raise ValueError(f"unknown scheduler {value!r}; scheduler names are case-sensitive: write {by_lower[value.lower()]!r}")
            raise ValueError(
                f"unknown scheduler {value!r}.{_suggest(value, list(SCHEDULER_TYPES))} Known: {', '.join(SCHEDULER_TYPES)}"
            )
        return value

    @field_validator("params", mode="before")
    @classmethod
    def _numbers(cls, value: Any) -> Any:
        return plain_numbers(value)
