"""zerorun's ZeRO runtime: the engine, stages 0-3, mixed precision, offload, checkpoints.

Imports torch; never imported by the launcher or the CLI at module level. Start with
``engine.py`` (reads top to bottom) and ``partition.py`` (the vocabulary).
"""

from __future__ import annotations

__all__: list[str] = []
