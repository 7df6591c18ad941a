"""``deepspeed.checkpoint``: only ``utils.clone_tensors_for_torch_save``. Checkpoints themselves
are ``engine.save_checkpoint``/``load_checkpoint`` (DeepSpeed's ``global_step{N}`` + ``latest``
layout, zerorun's shard format: docs/checkpoints.md)."""

from __future__ import annotations

import importlib
from typing import Any

from zerorun.compat.deepspeed._surface import module_getattr

__all__ = ["utils"]

_missing = module_getattr(__name__)


def __getattr__(name: str) -> Any:
    if name == "utils":
        return importlib.import_module(f"{__name__}.utils")
    return _missing(name)
