"""``deepspeed.checkpointing`` (DeepSpeed's ``runtime.activation_checkpointing.checkpointing``):
``checkpoint``, ``configure``, ``is_configured``, ``reset`` -- zerorun.checkpointing itself.
Other names (Megatron's RNG tracker helpers) raise an error naming them."""

from __future__ import annotations

from typing import Any

from zerorun.checkpointing import checkpoint, configure, is_configured, reset
from zerorun.compat.deepspeed._surface import module_getattr

__all__ = ["checkpoint", "configure", "is_configured", "reset"]

_missing = module_getattr(__name__)


def __getattr__(name: str) -> Any:
    return _missing(name)
