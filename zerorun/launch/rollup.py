"""What the console shows of a job too large to show rank by rank (pure, no I/O).

Above `console.DETAIL_MAX_RANKS` ranks the console prints the detail ranks' lines (rank 0, or
`--ranks`), and of every other rank only the notable lines (warnings, errors, tracebacks),
each distinct text once with the set of ranks that printed it (`[0-7999] UserWarning: ...`).
Everything still goes to the log files. The live panel and the periodic status line use the
roll-ups here: one row per node, and job-wide figures (step spread, slowest node, memory range).
"""

from __future__ import annotations

import heapq
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from zerorun.launch.result import RankState

__all__ = ["rank_set", "is_notable", "Dedup", "NodeRow", "node_rows", "JobRollup", "job_rollup"]

# Lines worth showing from any rank. Whole words, so `errors=0` or `warnings_total` in a
# metrics line do not count.
_NOTABLE = re.compile(r"(?i)\b(warning|error|exception|traceback|fatal|critical|killed|oom|nan)\b|Warning:|Error:")


def is_notable(text: str) -> bool:
    return _NOTABLE.search(text) is not None


def rank_set(ranks: Iterable[int], *, max_chars: int = 48) -> str:
    """Sorted ranks as ranges: `[0-7999]`, `[0-3,5,8-9]`; a long set is cut:
    `[0-3,5,...,7999] (812 ranks)`."""
    values = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    text = ",".join(parts)
    if len(text) <= max_chars:
        return f"[{text}]"
    kept: list[str] = []
    for p in parts[:-1]:
        if len(",".join([*kept, p])) > max_chars - len(parts[-1]) - 5:
            break
        kept.append(p)
    return f"[{','.join(kept)},...,{parts[-1]}] ({len(values)} ranks)"


class Dedup:
    """Identical lines from many ranks, shown once with their rank set.

    The first time a text is seen a window of `window_s` opens; every rank printing the same
    text in that window joins it; when it closes, `due()` returns one line for the text. Later
    copies from ranks already shown are only counted (`repeats`); new ranks open a new window.
    At most `max_texts` distinct texts are remembered (the oldest are forgotten)."""

    def __init__(self, *, window_s: float = 1.0, max_texts: int = 10_000) -> None:
        self.window_s = window_s
        self.max_texts = max_texts
        self._shown: OrderedDict[str, set[int]] = OrderedDict()
        self._open: dict[str, tuple[float, set[int], list[int]]] = {}  # text -> (closes, ranks, [count])
        self._heap: list[tuple[float, str]] = []
        self.repeats = 0

    def add(self, rank: int, text: str, now: float) -> None:
        shown = self._shown.get(text)
        if shown is not None and rank in shown:
            self.repeats += 1
            return
        window = self._open.get(text)
        if window is None:
            window = (now + self.window_s, set(), [0])
            self._open[text] = window
            heapq.heappush(self._heap, (window[0], text))
        window[1].add(rank)
        window[2][0] += 1

    def due(self, now: float, *, flush: bool = False) -> list[str]:
        """Lines whose window has closed (all of them with `flush`), in the order they opened."""
        out: list[str] = []
        while self._heap and (flush or self._heap[0][0] <= now):
            _, text = heapq.heappop(self._heap)
            window = self._open.pop(text, None)
            if window is None:
                continue
            _, ranks, count = window
            times = f" (x{count[0]})" if count[0] > len(ranks) else ""
            out.append(f"{rank_set(ranks)} {text}{times}")
            shown = self._shown.setdefault(text, set())
            shown |= ranks
            self._shown.move_to_end(text)
            while len(self._shown) > self.max_texts:
                self._shown.popitem(last=False)
        return out


@dataclass
class NodeRow:
    node_rank: int
    host: str
    running: int = 0
    exited: int = 0  # exit 0
    failed: int = 0  # failed, stopped, lost
    step_min: int | None = None
    step_max: int | None = None
    gpu_min: int | None = None
    gpu_max: int | None = None
    rss_min: int | None = None
    rss_max: int | None = None
    last_line: str = ""


def _step(s: RankState) -> int | None:
    value = (s.status or {}).get("step")
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _lo(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _hi(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def node_rows(states: Sequence[RankState], hosts: Mapping[int, str], last_lines: Mapping[int, str]) -> list[NodeRow]:
    """One row per node (by node rank) from the ranks' states."""
    rows: dict[int, NodeRow] = {}
    for s in states:
        n = s.spec.node_rank
        row = rows.get(n)
        if row is None:
            row = rows[n] = NodeRow(n, hosts.get(n, s.spec.host), last_line=last_lines.get(n, ""))
        if s.returncode is None and s.state != "lost":
            row.running += 1
        elif s.returncode == 0:
            row.exited += 1
        else:
            row.failed += 1
        step = _step(s)
        row.step_min, row.step_max = _lo(row.step_min, step), _hi(row.step_max, step)
        gpu = (s.gpu or {}).get("allocated")
        row.gpu_min, row.gpu_max = _lo(row.gpu_min, gpu), _hi(row.gpu_max, gpu)
        row.rss_min, row.rss_max = _lo(row.rss_min, s.rss), _hi(row.rss_max, s.rss)
    return [rows[n] for n in sorted(rows)]


@dataclass
class JobRollup:
    ranks: int
    counts: dict[str, int]
    step_min: int | None
    step_max: int | None
    slowest_node: str | None
    gpu_min: int | None
    gpu_max: int | None
    rss_min: int | None
    rss_max: int | None


def job_rollup(rows: Sequence[NodeRow], states: Sequence[RankState]) -> JobRollup:
    counts: dict[str, int] = {}
    for s in states:
        counts[s.state] = counts.get(s.state, 0) + 1
    slow = min((r for r in rows if r.step_min is not None), key=lambda r: r.step_min or 0, default=None)
    return JobRollup(
        ranks=len(states),
        counts=counts,
        step_min=min((r.step_min for r in rows if r.step_min is not None), default=None),
        step_max=max((r.step_max for r in rows if r.step_max is not None), default=None),
        slowest_node=slow.host if slow is not None else None,
        gpu_min=min((r.gpu_min for r in rows if r.gpu_min is not None), default=None),
        gpu_max=max((r.gpu_max for r in rows if r.gpu_max is not None), default=None),
        rss_min=min((r.rss_min for r in rows if r.rss_min is not None), default=None),
        rss_max=max((r.rss_max for r in rows if r.rss_max is not None), default=None),
    )


def interesting_first(rows: Sequence[NodeRow]) -> list[NodeRow]:
    """Nodes with failed ranks first, then the slowest (lowest step), then by node rank."""
    return sorted(rows, key=lambda r: (-r.failed, r.step_min if r.step_min is not None else -1, r.node_rank))
