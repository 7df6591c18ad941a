"""Learning-rate schedules from the config, with DeepSpeed's semantics.

Like DeepSpeed's, these are stepped once per optimizer step (after it; skipped steps do not
count) and set ``lr`` on every param group. ``last_batch_iteration`` starts at -1; WarmupLR puts
the groups at ``warmup_min_lr`` on construction, WarmupCosineLR at 0, so the first update uses
that value, exactly as in DeepSpeed.
"""

from __future__ import annotations

import math
from typing import Any

from torch.optim import Optimizer

from zerorun.errors import RuntimeConfigError

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "build_scheduler", "SCHEDULERS"]


def _per_group(optimizer: Optimizer, value: float | list[float] | tuple[float, ...], name: str) -> list[float]:
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise RuntimeConfigError(
                f"scheduler.params.{name}: expected {n} values (one per param group), got {len(value)}"
            )
        return [float(v) for v in value]
    return [float(value)] * n


def _warmup_fraction(it: int, warmup_num_steps: int, warmup_type: str) -> float:
    if warmup_type == "log":
        return math.log(it + 1) / math.log(warmup_num_steps)
    return it / warmup_num_steps


class _Schedule:
    def __init__(self, optimizer: Optimizer, last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] = [g["lr"] for g in optimizer.param_groups]

    def get_lr(self) -> list[float]:  # pragma: no cover - abstract
        raise NotImplementedError

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        )
        self._set(self.get_lr())

    def _set(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = list(lrs)

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        if self.last_batch_iteration >= 0:
            self._set(self.get_lr())


def _check_warmup_type(warmup_type: str) -> str:
    if warmup_type not in ("log", "linear"):
        raise RuntimeConfigError(
            f"scheduler.params.warmup_type must be 'log' or 'linear', not {warmup_type!r}"
        )
    return warmup_type


class WarmupLR(_Schedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` (log or linear), then flat."""

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float | list[float] | tuple[float, ...] = 0.0,
        warmup_max_lr: float | list[float] | tuple[float, ...] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = _check_warmup_type(warmup_type)
        if last_batch_iteration == -1:
            self._set(list(self.min_lrs))

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        g = self._gamma()
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | list[float] | tuple[float, ...] = 0.0,
        warmup_max_lr: float | list[float] | tuple[float, ...] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = int(total_num_steps)
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return max(
            0.0,
            (self.total_num_steps - self.last_batch_iteration)
            / max(1.0, self.total_num_steps - self.warmup_num_steps),
        )


class WarmupCosineLR(_Schedule):
    """Ratio of each group's configured lr: warm up from ``warmup_min_ratio`` to 1, then cosine
    decay to ``cos_min_ratio`` at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = _check_warmup_type(warmup_type)
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._set([0.0] * len(self.org_lrs))

    def _ratio(self) -> float:
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            r = _warmup_fraction(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + r * (1.0 - self.warmup_min_ratio)
        real_step = it - self.warmup_num_steps + 1
        real_total = max(1, self.total_num_steps - self.warmup_num_steps)
        r = (1 + math.cos(math.pi * real_step / real_total)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * r)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0] * len(self.org_lrs)
        ratio = self._ratio()
        return [lr * ratio for lr in self.org_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration, "org_lrs": list(self.org_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.org_lrs = [float(v) for v in state.get("org_lrs", self.org_lrs)]
        super().load_state_dict(state)


SCHEDULERS: dict[str, type[_Schedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


def build_scheduler(type_name: str, params: dict[str, Any], optimizer: Optimizer) -> _Schedule:
    """``scheduler: {type, params}`` from the config -> a schedule bound to ``optimizer``."""
    cls = SCHEDULERS.get(type_name)
    if cls is None:
        raise RuntimeConfigError(
            f"scheduler.type {type_name!r} is not supported; use one of {', '.join(SCHEDULERS)}, "
            "or pass lr_scheduler=callable(optimizer) to zerorun.initialize"
        )
    params = dict(params)
    # What a script's optimizer already says, DeepSpeed-style `auto` may take from it.
    if params.get("warmup_max_lr") == "auto":
        params["warmup_max_lr"] = [g["lr"] for g in optimizer.param_groups]
    if params.get("warmup_min_lr") == "auto":
        params["warmup_min_lr"] = 0.0
    for key, value in params.items():
        if value == "auto":
            raise RuntimeConfigError(
                f"scheduler.params.{key} is 'auto' and zerorun cannot fill it here: set a number in the config"
            )
    try:
        return cls(optimizer, **params)
    except TypeError as exc:
        raise RuntimeConfigError(f"scheduler.params for {type_name}: {exc}") from None
