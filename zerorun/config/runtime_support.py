"""What zerorun's runtime builds from `optimizer:` and `scheduler:`, known without importing torch.

The runtime (runtime/optimizer.py `ELEMENTWISE`, runtime/scheduler.py `SCHEDULERS`) fails at
`zerorun.initialize` -- on every rank, after the launch -- for an optimizer or scheduler it does
not build, or for a keyword its constructor does not take. Checking the config against these
tables catches that before a single rank starts. tests/config/test_runtime_support.py keeps
them in step with the runtime and with torch's signatures.
"""

from __future__ import annotations

__all__ = ["OPTIMIZER_KWARGS", "SCHEDULER_KWARGS", "DEEPSPEED_ADAM_EXTRAS"]

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
