"""``deepspeed.utils``: ``logger``, ``log_dist``, the ZeRO-3 leaf-module functions
(z3_leaf_module.py), and ``zero_to_fp32`` (loaded on first use)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Any

from zerorun.compat.deepspeed._surface import module_getattr
from zerorun.compat.deepspeed.utils.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

__all__ = [
    "logger",
    "log_dist",
    "zero_to_fp32",
    "z3_leaf_module",
    "z3_leaf_parameter",
    "get_z3_leaf_modules",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
]

# DeepSpeed's logger, at DeepSpeed's level (INFO): tools capture its records, e.g. the
# "DeepSpeed info: version=..." line `deepspeed.initialize` logs. No handler is added (DeepSpeed
# adds one on stdout; zerorun keeps the ranks' stdout for the script): records reach the
# handlers the program configures.
logger = logging.getLogger("DeepSpeed")
logger.setLevel(logging.INFO)
_missing = module_getattr(__name__)


def __getattr__(name: str) -> Any:
    if name == "zero_to_fp32":
        return importlib.import_module(f"{__name__}.zero_to_fp32")
    return _missing(name)


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """Log on the given ranks (all when ``ranks`` is None or contains -1), as DeepSpeed does."""
    from zerorun.compat.deepspeed import comm

    rank = comm.get_rank()
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")
