"""``deepspeed.utils``: ``logger``, ``log_dist``, and ``zero_to_fp32`` (loaded on first use)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Any

from zerorun.compat.deepspeed._surface import module_getattr

__all__ = ["logger", "log_dist", "zero_to_fp32"]

logger = logging.getLogger("DeepSpeed")
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
