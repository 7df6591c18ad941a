"""What the launcher's consoles show, as text and rich renderables: rank prefixes, the cells and
rows of the live panel (one row per rank, or per node in the large-job view), the end summary,
the memory-by-component table, the failure panel's lines.

Pure functions of the supervisor's state (`RankState`, `JobResult`, `launch/rollup.py`'s roll-ups);
the consoles that print them as the job runs are `launch/console.py`. `rich` is imported only by
the functions that build rich renderables.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from zerorun.launch import rollup
from zerorun.launch.plan import LaunchPlan
from zerorun.launch.result import JobResult, RankState, describe_exit
from zerorun.launch.text_table import table_text

__all__ = [
    "format_bytes",
    "flatten_breakdown",
    "prefixes",
    "gpu_cell",
    "step_cell",
    "exit_cell",
    "summary_rows",
    "breakdown_rows",
    "failure_lines",
    "table_text",
    "rollup_text",
    "large_summary_lines",
    "large_note",
    "rank_table",
    "node_table",
    "result_table",
]

_FAILURE_TAIL = 12
# Large jobs: rows of the end summary listing ranks that did not exit 0.
_SUMMARY_ROWS = 20


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def flatten_breakdown(breakdown: Mapping[str, Any] | None, prefix: str = "") -> dict[str, float]:
    """The runtime's per-component bytes, nested by device or not -> {"cuda:0.params": n}."""
    out: dict[str, float] = {}
    for key, value in (breakdown or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_breakdown(value, prefix=f"{name}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
    return out


def prefixes(plan: LaunchPlan, states: Sequence[RankState]) -> dict[int, str]:
    """Every rank's prefix, padded to one width so the text after it lines up."""
    named = len(plan.nodes) > 1 or not plan.nodes[0].is_local  # a remote node: say which
    specs = plan.ranks  # built once: `plan.ranks` is a new list on every access
    raw = {s.rank: f"[{specs[s.rank].host}:{s.rank}]" if named else f"[{s.rank}]" for s in states}
    width = max((len(p) for p in raw.values()), default=0)
    return {r: p.ljust(width) for r, p in raw.items()}


def gpu_cell(s: RankState) -> str:
    if not s.gpu:
        return "-"
    return "/".join(format_bytes(s.gpu.get(k)) for k in ("allocated", "reserved", "peak"))


def _si(value: float) -> str:
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{prefix}"
    return f"{value:.1f}"


def step_cell(s: RankState) -> str:
    if not s.status:
        return "-"
    parts = []
    if "step" in s.status:
        parts.append(f"step {s.status['step']}")
    if isinstance(s.status.get("loss"), (int, float)):
        parts.append(f"loss {s.status['loss']:.4g}")
    for key, unit in (("tokens_per_sec", "tok/s"), ("samples_per_sec", "samples/s")):
        if isinstance(s.status.get(key), (int, float)):
            parts.append(f"{_si(s.status[key])} {unit}")
            break
    timers = s.status.get("timers_ms")  # wall_clock_breakdown: this rank's own, so a straggler shows
    if isinstance(timers, dict) and all(isinstance(timers.get(k), (int, float)) for k in ("fwd", "bwd", "step")):
        parts.append(f"fwd/bwd/step {timers['fwd']:.0f}/{timers['bwd']:.0f}/{timers['step']:.0f} ms")
    return " ".join(parts) or "-"


def exit_cell(s: RankState) -> str:
    if s.returncode is None:
        return s.state
    text = describe_exit(s.returncode).split(":")[0]
    return f"{text} (stopped)" if s.state == "stopped" else text


def summary_rows(result: JobResult) -> tuple[list[str], list[list[str]]]:
    head = ["rank", "host", "exit", "wall", "peak GPU", "peak RSS"]
    rows = []
    for s in result.ranks:
        rows.append(
            [
                str(s.rank),
                s.spec.host,
                exit_cell(s),
                f"{s.wall_s:.1f} s" if s.wall_s is not None else "-",
                format_bytes(s.gpu_peak),
                format_bytes(s.rss_peak),
            ]
        )
    return head, rows


def breakdown_rows(result: JobResult) -> tuple[list[str], list[list[str]]]:
    """The measured table 4.2 of the article: bytes per component (params, grads, optimizer
    states, ...) per rank, as the runtime reported them last."""
    flat = {s.rank: flatten_breakdown(s.breakdown) for s in result.ranks}
    keys: list[str] = []
    for d in flat.values():
        keys.extend(k for k in d if k not in keys)
    if not keys:
        return [], []
    rows = [[str(r), *(format_bytes(flat[r].get(k)) if k in flat[r] else "-" for k in keys)] for r in flat]
    return ["rank", *keys], rows


def failure_lines(result: JobResult) -> list[str]:
    lines = [result.message] if result.message else []
    lines.extend(result.hang_report)
    if result.first_failure is not None:
        s = next(x for x in result.ranks if x.rank == result.first_failure)
        lines.append(f"rank {s.rank} on {s.spec.host} (pid {s.pid}): {describe_exit(s.returncode or 0)}")
        if s.error:
            lines.append(f"exception: {s.error.get('type')}: {s.error.get('message')}")
        tail = list(s.stderr_tail)[-_FAILURE_TAIL:] or list(s.stdout_tail)[-_FAILURE_TAIL:]
        if tail:
            lines.append(f"last lines of rank {s.rank}:")
            lines.extend(f"  {t}" for t in tail)
    if result.log_dir:
        lines.append(f"logs: {result.log_dir}")
    return lines


def rollup_text(job: rollup.JobRollup) -> str:
    counts = ", ".join(f"{n} {state}" for state, n in sorted(job.counts.items(), key=lambda x: -x[1]))
    parts = [f"{job.ranks} ranks: {counts}"]
    if job.step_min is not None:
        parts.append(f"step {job.step_min}-{job.step_max} (slowest node {job.slowest_node})")
    if job.gpu_max is not None:
        parts.append(f"GPU {format_bytes(job.gpu_min)}-{format_bytes(job.gpu_max)}")
    if job.rss_max is not None:
        parts.append(f"RSS {format_bytes(job.rss_min)}-{format_bytes(job.rss_max)}")
    return " | ".join(parts)


def large_summary_lines(result: JobResult) -> list[str]:
    """The end summary of a large job: exits counted, the ranks that did not exit 0 (the first
    `_SUMMARY_ROWS`), memory ranges."""
    counts = Counter(exit_cell(s) for s in result.ranks)
    lines = [f"{len(result.ranks)} ranks: " + ", ".join(f"{n} {what}" for what, n in counts.most_common())]
    bad = [s for s in result.ranks if s.returncode != 0]
    if bad:
        head, rows = summary_rows(replace(result, ranks=bad[:_SUMMARY_ROWS]))
        lines.append(f"ranks that did not exit 0 ({len(bad)}):")
        lines.extend(f"  {t}" for t in table_text(head, rows))
        if len(bad) > _SUMMARY_ROWS:
            lines.append(f"  ... and {len(bad) - _SUMMARY_ROWS} more (summary.json has them all)")
    gpu = [s.gpu_peak for s in result.ranks if s.gpu_peak is not None]
    rss = [s.rss_peak for s in result.ranks if s.rss_peak is not None]
    if gpu:
        lines.append(f"peak GPU per rank {format_bytes(min(gpu))} - {format_bytes(max(gpu))}")
    if rss:
        lines.append(f"peak RSS per rank {format_bytes(min(rss))} - {format_bytes(max(rss))}")
    return lines


def large_note(plan: LaunchPlan, detail: frozenset[int]) -> str:
    return (
        f"{plan.world_size} ranks on {len(plan.nodes)} node(s): showing the lines of rank(s) "
        f"{rollup.rank_set(detail)} and, of the others, warnings and errors once per distinct text "
        "(--ranks selects other ranks; --log_dir keeps every line of every rank)"
    )


def rank_table(
    states: Sequence[RankState], prefix: Mapping[int, str], styles: Mapping[int, str], elapsed: float
) -> Any:
    """The live panel of a job up to `DETAIL_MAX_RANKS` ranks: one row per rank."""
    from rich.table import Table
    from rich.text import Text

    counts = Counter(s.state for s in states)
    caption = ", ".join(f"{n} {state}" for state, n in counts.items()) + f" | {elapsed:.0f} s"
    table = Table(box=None, pad_edge=False, header_style="bold", expand=False, caption=caption,
                  caption_justify="left")
    for col in ("rank", "state", "pid", "GPU alloc/reserved/peak", "RSS", "progress"):
        table.add_column(col)
    for s in states:
        style = styles.get(s.rank, "")
        table.add_row(
            # Text, not markup: a `[host:3]` prefix would read as a style tag.
            Text(prefix.get(s.rank, str(s.rank)), style=style),
            s.state if s.returncode is None else exit_cell(s),
            str(s.pid or "-"),
            gpu_cell(s),
            format_bytes(s.rss),
            step_cell(s),
        )
    return table


def node_table(rows: Sequence[rollup.NodeRow], job: rollup.JobRollup, room: int, elapsed: float) -> Any:
    """The large-job live panel: one row per node, the most interesting first (failed ranks, then
    the slowest), at most `room` of them; the job's roll-up as the caption."""
    from rich.table import Table

    shown = rollup.interesting_first(rows)[:room]
    caption = rollup_text(job) + f" | {elapsed:.0f} s"
    if len(rows) > len(shown):
        caption += f" | {len(rows) - len(shown)} more node(s)"
    table = Table(box=None, pad_edge=False, header_style="bold", expand=False, caption=caption,
                  caption_justify="left")
    for col in ("node", "running/ok/failed", "step (slowest-fastest)", "GPU min-max", "RSS min-max", "last line"):
        table.add_column(col, no_wrap=True, overflow="ellipsis", max_width=60 if col == "last line" else None)
    for r in shown:
        step = "-" if r.step_min is None else f"{r.step_min}-{r.step_max}"
        table.add_row(
            r.host,
            f"{r.running}/{r.exited}/{r.failed}",
            step,
            f"{format_bytes(r.gpu_min)}-{format_bytes(r.gpu_max)}" if r.gpu_max is not None else "-",
            f"{format_bytes(r.rss_min)}-{format_bytes(r.rss_max)}" if r.rss_max is not None else "-",
            r.last_line,
            style="red" if r.failed else "",
        )
    return table


def result_table(title: str, head: Sequence[str], rows: Sequence[Sequence[str]]) -> Any:
    """One of the end tables (summary, memory by component) as a rich table."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for h in head:
        table.add_column(h)
    for row in rows:
        table.add_row(*row)
    return table
