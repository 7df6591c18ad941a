"""Plain-text tables, one format for everything the launcher lists in rows: the console's end
summaries (`launch/console_format.py`) and the table of nodes that failed before anything started
(`launch/fanout.failure_table`). Columns left-aligned, two spaces apart. Stdlib only."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["table_text"]


def table_text(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*head), *(fmt.format(*r) for r in rows)]
