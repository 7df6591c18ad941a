"""``deepspeed.runtime``: ``engine``, ``zero``, ``lr_schedules`` (loaded on first use)."""

from __future__ import annotations

import importlib
from typing import Any

from zerorun.compat.deepspeed._surface import module_getattr

__all__ = ["engine", "zero", "lr_schedules"]

_missing = module_getattr(__name__)


def __getattr__(name: str) -> Any:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    return _missing(name)
