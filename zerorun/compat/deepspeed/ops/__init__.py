"""``deepspeed.ops``: ``adam`` (DeepSpeedCPUAdam, FusedAdam),
mapped to torch optimizers that zerorun's runtime (and its CPU offload) steps."""

from __future__ import annotations

import importlib
from typing import Any

from zerorun.compat.deepspeed._surface import module_getattr

__all__ = ["adam"]

_missing = module_getattr(__name__)


def __getattr__(name: str) -> Any:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    return _missing(name)
