"""Mixed-precision policy and the fp16 loss scaler (DeepSpeed's semantics)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerorun.errors import RuntimeConfigError

__all__ = ["MixedPrecisionPolicy", "LossScaler", "DTYPE_NAMES", "dtype_name", "dtype_from_name"]

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    return DTYPE_NAMES[name]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Which dtype each copy of the model state has.

    param_dtype: the parameters the forward/backward computes with (and the all-gathered ones).
    reduce_dtype: gradients are accumulated and reduced in this dtype.
    master_dtype: the optimizer's copy; when equal to param_dtype no separate copy is kept.
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32


class LossScaler:
    """DeepSpeed's DynamicLossScaler (``loss_scale: 0``) or a static scale (``loss_scale > 0``).

    Dynamic rule, as in DeepSpeed: on overflow, while hysteresis is left, decrement it; once it
    is used up, halve the scale (never below ``min_scale``; already at the minimum -> error). After
    ``window`` steps without overflow since the last one, double the scale and restore the
    hysteresis. An overflow on any rank is an overflow everywhere (the engine reduces the flag).
    """

    def __init__(
        self,
        *,
        dynamic: bool,
        init_scale: float,
        window: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        self.dynamic = dynamic
        self.scale = float(init_scale)
        self.window = int(window)
        self.hysteresis = int(hysteresis)
        self.cur_hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @classmethod
    def disabled(cls) -> LossScaler:
        return cls(dynamic=False, init_scale=1.0)

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            self.cur_iter += 1
            return
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.scale == self.min_scale and self.raise_error_at_min_scale:
                    raise RuntimeConfigError(
                        f"fp16 loss scale is already at its minimum ({self.min_scale:g}) and gradients "
                        "still overflow: training diverged. Lower the learning rate, use bf16 instead "
                        "of fp16, or lower fp16.min_loss_scale."
                    )
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            if (self.cur_iter - self.last_overflow_iter) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= 2.0
        self.cur_iter += 1

    def state_dict(self) -> dict[str, float | int | bool]:
        return {
            "dynamic": self.dynamic,
            "scale": self.scale,
            "cur_hysteresis": self.cur_hysteresis,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
        }

    def load_state_dict(self, state: dict[str, float | int | bool]) -> None:
        self.scale = float(state["scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
