"""What happens at the edge of the layer: a name DeepSpeed has and zerorun does not.

Every such access raises ``NotInCompatLayer`` naming the symbol (an ``AttributeError`` too,
so ``hasattr`` probes keep working) and is recorded in ``MISSES``: the surface test runs
Trainer and fails when transformers or accelerate reach for something new. Python turns an
``AttributeError`` raised during ``from deepspeed.x import y`` into its own "cannot import name"
``ImportError`` and drops the message, so there the same message comes as
``NotInCompatLayerImport`` (an ``ImportError``): the module ``__getattr__`` looks at the
instruction its caller is running.
"""

from __future__ import annotations

import dis
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from zerorun.errors import RuntimeConfigError

__all__ = ["NotInCompatLayer", "NotInCompatLayerImport", "MISSES", "missing", "module_getattr", "unsupported"]

MISSES: list[str] = []
_GUIDE = "docs/migration-from-deepspeed.md lists what the layer provides"


class NotInCompatLayer(RuntimeConfigError, AttributeError):
    """A DeepSpeed symbol that zerorun's compatibility layer does not provide."""


class NotInCompatLayerImport(RuntimeConfigError, ImportError):
    """``from deepspeed.x import y`` of a symbol the layer does not provide."""


_IMPORT_FROM = dis.opmap["IMPORT_FROM"]


def _in_from_import() -> bool:
    """Whether the code that asked a module ``__getattr__`` (past the layer's own
    ``__getattr__`` frames) is executing ``from M import NAME``: the interpreter calls the
    module's ``__getattr__`` straight from that instruction."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name == "__getattr__":
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return False
    try:
        return frame.f_code.co_code[frame.f_lasti] == _IMPORT_FROM
    except IndexError:
        return False


def _message(symbol: str) -> str:
    return f"{symbol} is not provided by zerorun's DeepSpeed compatibility layer; {_GUIDE}"


def missing(symbol: str) -> NotInCompatLayer:
    MISSES.append(symbol)
    return NotInCompatLayer(_message(symbol))


def module_getattr(module_name: str) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``deepspeed.<...>`` modules (dunder probes stay quiet)."""
    public = "deepspeed" + module_name[len("zerorun.compat.deepspeed") :]

    def __getattr__(name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if _in_from_import():
            MISSES.append(f"{public}.{name}")
            raise NotInCompatLayerImport(_message(f"{public}.{name}"), name=public)
        raise missing(f"{public}.{name}")

    return __getattr__


def unsupported(symbol: str, why: str) -> NoReturn:
    """A DeepSpeed feature the layer knows about and does not implement."""
    MISSES.append(symbol)
    raise RuntimeConfigError(f"{symbol}: {why} (zerorun's DeepSpeed compatibility layer; {_GUIDE})")
