"""The zerorun configurations, through the public API a DeepSpeed user calls:

    engine, optimizer, _, _ = zerorun.initialize(model=model, config=ds_config)
    loss = engine(x, y); engine.backward(loss); engine.step()

The harness does nothing zerorun-specific beyond that, so what it measures is what a user gets.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["ZerorunTrainer"]


class ZerorunTrainer:
    def __init__(self, model: nn.Module, ds_config: dict[str, Any]) -> None:
        import zerorun  # lazily: a missing or broken runtime fails this configuration only

        self.engine, self.optimizer, _, _ = zerorun.initialize(model=model, config=ds_config)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.engine(x, y)
        self.engine.backward(loss)
        return loss.detach()

    def optimizer_step(self) -> None:
        self.engine.step()

    def memory_report(self) -> dict[str, Any] | None:
        """`engine.memory_summary()` made JSON-safe; None if the engine has none yet."""
        summary = getattr(self.engine, "memory_summary", None)
        if summary is None:
            return None
        return to_jsonable(summary())

    def offload_profile(self) -> dict[str, float] | None:
        """Where the last step's offload time went (docs/offload.md: gradient/io waits, CPU
        Adam, staging, training-thread wait), in seconds; None without an offload placement."""
        state = getattr(getattr(self.engine, "stage", None), "state", None)
        profile = getattr(getattr(state, "placement", None), "last_profile", None)
        return {str(k): float(v) for k, v in profile.items()} if profile else None


def to_jsonable(value: Any) -> Any:
    """Dicts/lists/numbers as they are; dataclasses and objects via their fields; tensors as
    numbers; anything else as its repr — a summary format change must not lose a result."""
    import dataclasses

    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(dataclasses.asdict(value))
    if hasattr(value, "_asdict"):
        return to_jsonable(value._asdict())
    if hasattr(value, "__dict__"):
        return to_jsonable(vars(value))
    return repr(value)
