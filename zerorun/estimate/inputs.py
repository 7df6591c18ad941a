"""What the memory model takes: a config in any form (ZerorunConfig, LoadedConfig, DeepSpeed
dict), a parameter count as people write it, and the byte units it reports in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GB = 1e9
GIB = float(2**30)


def _as_config(config: Any) -> Any:
    if config is None:
        return None
    if hasattr(config, "zero_optimization"):
        return config
    if hasattr(config, "config"):  # LoadedConfig
        return config.config
    if isinstance(config, Mapping):
        from zerorun.config import load_config

        return load_config(dict(config)).config
    raise TypeError(f"config must be a ZerorunConfig, LoadedConfig or dict, not {type(config).__name__}")


_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str | int | float) -> int:
    """A parameter count as people write it: 7.5e9, 7.5B, 350M, 1.3b, 7_000_000_000."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value = float(text)
    else:
        t = str(text).strip().replace("_", "").replace(",", "")
        scale = 1
        if t and t[-1].lower() in _SUFFIXES:
            scale = _SUFFIXES[t[-1].lower()]
            t = t[:-1]
        try:
            value = float(t) * scale
        except ValueError:
            raise ValueError(f"{text!r} is not a count; write e.g. 7.5e9, 7.5B or 350M") from None
    if not value >= 0 or value != value or value == float("inf"):
        raise ValueError(f"{text!r} is not a non-negative count")
    return int(round(value))
