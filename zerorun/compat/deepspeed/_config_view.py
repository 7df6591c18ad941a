"""The config zerorun's runtime gets from a DeepSpeed config dict: what ``deepspeed.initialize``
and ``deepspeed.zero.Init`` both validate (one module both import; neither imports the other)."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["NO_PERIODIC_PRINTS", "runtime_view"]

# A step count no run reaches: `steps_per_print` this large means no periodic prints (report.py
# prints at step % steps_per_print == 0, and reads pending steps every MAX_PENDING steps anyway).
NO_PERIODIC_PRINTS = sys.maxsize


def runtime_view(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config zerorun's runtime gets. accelerate writes ``steps_per_print: inf`` to mean
    "never print" (DeepSpeed then prints no step lines); zerorun's runtime, like DeepSpeed, would
    print rank 0's ``[Rank 0] step=...`` line every `steps_per_print` steps, so inf (or any value
    past NO_PERIODIC_PRINTS) becomes NO_PERIODIC_PRINTS rather than being refused as not a count."""
    value = cfg.get("steps_per_print")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > NO_PERIODIC_PRINTS:
        cfg = dict(cfg, steps_per_print=NO_PERIODIC_PRINTS)
    return cfg
