"""``deepspeed.zero`` (= ``deepspeed.runtime.zero``): ``Init``, ``GatheredParameters``,
``register_external_parameter`` -- zerorun's stage-3 implementations (zerorun/zero.py)."""

from __future__ import annotations

import importlib
from typing import Any

from zerorun.compat.deepspeed._surface import module_getattr
from zerorun.compat.deepspeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    register_external_parameter,
)

__all__ = ["Init", "GatheredParameters", "register_external_parameter", "partition_parameters"]

_missing = module_getattr(__name__)


def __getattr__(name: str) -> Any:
    if name == "partition_parameters":
        return importlib.import_module(f"{__name__}.partition_parameters")
    return _missing(name)
