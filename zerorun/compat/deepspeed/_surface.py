"""What happens at the edge of the layer: a name DeepSpeed has and zerorun does not.

Every such access raises ``NotInCompatLayer`` naming the symbol (an ``AttributeError`` too,
so ``hasattr`` probes keep working) and is recorded in ``MISSES``: the surface test runs
Trainer and fails when transformers or accelerate reach for something new.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from zerorun.errors import RuntimeConfigError

__all__ = ["NotInCompatLayer", "MISSES", "missing", "module_getattr", "unsupported"]

MISSES: list[str] = []
_GUIDE = "docs/migration-from-deepspeed.md lists what the layer provides"


class NotInCompatLayer(RuntimeConfigError, AttributeError):
    """A DeepSpeed symbol that zerorun's compatibility layer does not provide."""


def missing(symbol: str) -> NotInCompatLayer:
    MISSES.append(symbol)
    return NotInCompatLayer(f"{symbol} is not provided by zerorun's DeepSpeed compatibility layer; {_GUIDE}")


def module_getattr(module_name: str) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``deepspeed.<...>`` modules (dunder probes stay quiet)."""
    public = "deepspeed" + module_name[len("zerorun.compat.deepspeed") :]

    def __getattr__(name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise missing(f"{public}.{name}")

    return __getattr__


def unsupported(symbol: str, why: str) -> NoReturn:
    """A DeepSpeed feature the layer knows about and does not implement."""
    MISSES.append(symbol)
    raise RuntimeConfigError(f"{symbol}: {why} (zerorun's DeepSpeed compatibility layer; {_GUIDE})")
