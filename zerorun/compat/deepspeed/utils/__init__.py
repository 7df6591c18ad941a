"""``deepspeed.utils``: ``logger`` and ``log_dist``."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from zerorun.compat.deepspeed._surface import module_getattr

__all__ = ["logger", "log_dist"]

logger = logging.getLogger("DeepSpeed")
__getattr__ = module_getattr(__name__)


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """Log on the given ranks (all when ``ranks`` is None or contains -1), as DeepSpeed does."""
    from zerorun.compat.deepspeed import comm

    rank = comm.get_rank()
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")
