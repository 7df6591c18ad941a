"""zerorun: a launcher and ZeRO runtime for PyTorch.

`import zerorun` stays cheap (no torch): the runtime API is resolved lazily on first use,
so the launcher and `zerorun --help` start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerorun._version import __version__

__all__ = ["__version__", "initialize", "zero"]

if TYPE_CHECKING:  # pragma: no cover
    from zerorun.runtime.api import initialize as initialize


def __getattr__(name: str) -> Any:
    if name == "initialize":
        from zerorun.runtime.api import initialize

        return initialize
    if name == "zero":
        import importlib

        return importlib.import_module("zerorun.zero")
    raise AttributeError(f"module 'zerorun' has no attribute {name!r}")
