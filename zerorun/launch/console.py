"""What the launcher shows: rank output with prefixes, a live per-rank panel, the end summary.

Rendering only; the supervisor owns the state. Two implementations of one interface
(`supervisor.Console`):
- `PlainConsole` when stdout is not a terminal: `[rank] line` (`[host:rank]` once several
  nodes run), rank stdout to stdout and rank stderr to stderr, no escape codes, and the same
  summary as plain text. Lines are written in batches, so the console keeps up with ranks
  printing as fast as they can.
- `RichConsole` on a terminal: one colour per rank, stderr dimmed, a live panel under the
  scrolling output (state, pid, GPU alloc/reserved/peak, host RSS, last step), rich tables and
  a failure panel at the end.

Above `DETAIL_MAX_RANKS` ranks (a 1,000-node job prints 8,000 lines a step) both switch to the
large-job view (`launch/rollup.py`): the detail ranks' lines (rank 0, or `--ranks`), every
other rank's notable lines (warnings, errors) once per distinct text with the ranks that
printed it (`[0-7999] UserWarning: ...`), a live panel with one row per node and job-wide
roll-ups (a status line every `status_interval_s` when plain), and a summary of the ranks that
did not exit 0. The log files under `--log_dir` keep every line of every rank.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import IO, Any, Literal

from zerorun.launch import rollup
from zerorun.launch.messages import RankOutput
from zerorun.launch.plan import LaunchPlan
from zerorun.launch.result import JobResult, RankState, describe_exit

__all__ = [
    "PlainConsole",
    "RichConsole",
    "make_console",
    "format_bytes",
    "flatten_breakdown",
    "DETAIL_MAX_RANKS",
]

_COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "bright_red", "bright_cyan", "bright_magenta")
_FAILURE_TAIL = 12
# Above this many ranks the console shows the large-job view (module docstring).
DETAIL_MAX_RANKS = 128
# Large jobs: rows of the end summary listing ranks that did not exit 0.
_SUMMARY_ROWS = 20
# The live panel is rebuilt at most this often (the supervisor calls refresh() every batch).
_PANEL_EVERY_S = 0.5


def make_console(*, ranks: frozenset[int] | None = None, force_plain: bool = False) -> PlainConsole | RichConsole:
    if not force_plain and sys.stdout.isatty():
        return RichConsole(ranks=ranks)
    return PlainConsole(ranks=ranks)


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


def _prefixes(plan: LaunchPlan, states: Sequence[RankState]) -> dict[int, str]:
    """Every rank's prefix, padded to one width so the text after it lines up."""
    named = len(plan.nodes) > 1 or not plan.nodes[0].is_local  # a remote node: say which
    specs = plan.ranks  # built once: `plan.ranks` is a new list on every access
    raw = {s.rank: f"[{specs[s.rank].host}:{s.rank}]" if named else f"[{s.rank}]" for s in states}
    width = max((len(p) for p in raw.values()), default=0)
    return {r: p.ljust(width) for r, p in raw.items()}


def _gpu_cell(s: RankState) -> str:
    if not s.gpu:
        return "-"
    return "/".join(format_bytes(s.gpu.get(k)) for k in ("allocated", "reserved", "peak"))


def _si(value: float) -> str:
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{prefix}"
    return f"{value:.1f}"


def _step_cell(s: RankState) -> str:
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


def _exit_cell(s: RankState) -> str:
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
                _exit_cell(s),
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


def _table_text(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*head), *(fmt.format(*r) for r in rows)]


class _LargeJob:
    """The large-job view's state: which lines print, the dedup of the others, each node's
    last line, and the job-wide roll-ups (see `launch/rollup.py`)."""

    def __init__(self, plan: LaunchPlan, states: Sequence[RankState], detail: frozenset[int] | None) -> None:
        self.states = states
        self.detail = detail if detail is not None else frozenset({0})
        self.node_of = {spec.rank: spec.node_rank for spec in plan.ranks}
        self.hosts = {n.node_rank: n.host.name for n in plan.nodes}
        self.dedup = rollup.Dedup()
        self.last_lines: dict[int, str] = {}

    def split(self, lines: Sequence[RankOutput]) -> list[RankOutput]:
        """The lines to print as they are (the detail ranks'); every notable line goes to the dedup."""
        now = time.monotonic()
        shown: list[RankOutput] = []
        for line in lines:
            self.last_lines[self.node_of.get(line.rank, -1)] = line.text
            if line.rank in self.detail:
                shown.append(line)
            # A detail rank's warning counts too: the line for everyone then names every rank.
            if rollup.is_notable(line.text):
                self.dedup.add(line.rank, line.text, now)
        return shown

    def rows(self) -> tuple[list[rollup.NodeRow], rollup.JobRollup]:
        rows = rollup.node_rows(self.states, self.hosts, self.last_lines)
        return rows, rollup.job_rollup(rows, self.states)

    def status_line(self) -> str:
        _, job = self.rows()
        return _rollup_text(job)


def _rollup_text(job: rollup.JobRollup) -> str:
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
    counts = Counter(_exit_cell(s) for s in result.ranks)
    lines = [f"{len(result.ranks)} ranks: " + ", ".join(f"{n} {what}" for what, n in counts.most_common())]
    bad = [s for s in result.ranks if s.returncode != 0]
    if bad:
        head, rows = summary_rows(replace(result, ranks=bad[:_SUMMARY_ROWS]))
        lines.append(f"ranks that did not exit 0 ({len(bad)}):")
        lines.extend(f"  {t}" for t in _table_text(head, rows))
        if len(bad) > _SUMMARY_ROWS:
            lines.append(f"  ... and {len(bad) - _SUMMARY_ROWS} more (summary.json has them all)")
    gpu = [s.gpu_peak for s in result.ranks if s.gpu_peak is not None]
    rss = [s.rss_peak for s in result.ranks if s.rss_peak is not None]
    if gpu:
        lines.append(f"peak GPU per rank {format_bytes(min(gpu))} - {format_bytes(max(gpu))}")
    if rss:
        lines.append(f"peak RSS per rank {format_bytes(min(rss))} - {format_bytes(max(rss))}")
    return lines


class PlainConsole:
    """Prefixed lines and plain-text tables: logs, pipes, CI."""

    def __init__(
        self,
        *,
        ranks: frozenset[int] | None = None,
        out: IO[str] | None = None,
        err: IO[str] | None = None,
    ) -> None:
        self.ranks = ranks
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.plan: LaunchPlan | None = None
        self._prefixes: dict[int, str] = {}
        self._dead: set[int] = set()
        self.detail_max_ranks = DETAIL_MAX_RANKS
        self.status_interval_s = 30.0
        self._large: _LargeJob | None = None
        self._next_status = 0.0

    def _write(self, stream: IO[str], text: str) -> None:
        """Write, and keep going if the reader went away (`zerorun ... | head`): the job
        keeps running and its log files are still written; only the console goes quiet."""
        if id(stream) in self._dead:
            return
        try:
            stream.write(text)
            stream.flush()
        except (BrokenPipeError, ValueError, OSError):
            self._dead.add(id(stream))

    def begin(self, plan: LaunchPlan, states: Sequence[RankState]) -> None:
        self.plan = plan
        self._prefixes = _prefixes(plan, states)
        self.note(
            f"run {plan.run_id}: {plan.world_size} rank(s) on {plan.device} ({plan.backend}), "
            f"master {plan.master_addr}:{plan.master_port}: {plan.target.display()}"
        )
        if plan.world_size > self.detail_max_ranks:
            self._large = _LargeJob(plan, states, self.ranks)
            self._next_status = time.monotonic() + self.status_interval_s
            self.note(_large_note(plan, self._large.detail))

    def output(self, lines: Sequence[RankOutput]) -> None:
        if self._large is not None:
            lines = self._large.split(lines)
        current: IO[str] | None = None
        chunk: list[str] = []
        for line in lines:
            if self._large is None and self.ranks is not None and line.rank not in self.ranks:
                continue
            stream = self.err if line.stream == "stderr" else self.out
            if stream is not current:
                if current is not None and chunk:
                    self._write(current, "".join(chunk))
                current, chunk = stream, []
            chunk.append(f"{self._prefixes.get(line.rank, f'[{line.rank}]')} {line.text}\n")
        if current is not None and chunk:
            self._write(current, "".join(chunk))

    def note(self, text: str, *, level: Literal["info", "warn", "error"] = "info") -> None:
        tag = {"info": "zerorun", "warn": "zerorun: warning", "error": "zerorun: error"}[level]
        self._write(self.err, f"{tag}: {text}\n")

    def refresh(self) -> None:
        if self._large is None:
            return
        now = time.monotonic()
        self._write_dedup(self._large.dedup.due(now))
        if now >= self._next_status:
            self._next_status = now + self.status_interval_s
            self.note(self._large.status_line())

    def _write_dedup(self, lines: Sequence[str]) -> None:
        if lines:
            self._write(self.err, "".join(f"{line}\n" for line in lines))

    def stop(self) -> None:
        pass

    def end(self, result: JobResult) -> None:
        parts = []
        if self._large is not None:
            self._write_dedup(self._large.dedup.due(0.0, flush=True))
        if result.exit_code != 0:
            parts.append("zerorun: FAILED\n" + "".join(f"  {line}\n" for line in failure_lines(result)))
        if self._large is not None:
            lines = large_summary_lines(result)
            parts.append("zerorun: summary\n" + "".join(f"  {line}\n" for line in lines))
            result = replace(result, ranks=[s for s in result.ranks if s.rank in self._large.detail])
        else:
            head, rows = summary_rows(result)
            parts.append("zerorun: summary\n" + "".join(f"  {line}\n" for line in _table_text(head, rows)))
        bhead, brows = breakdown_rows(result)
        if brows:
            parts.append(
                "zerorun: memory by component (last report)\n"
                + "".join(f"  {line}\n" for line in _table_text(bhead, brows))
            )
        parts.append(f"zerorun: exit code {result.exit_code} after {result.wall_s:.1f} s\n")
        self._write(self.err, "".join(parts))


def _large_note(plan: LaunchPlan, detail: frozenset[int]) -> str:
    return (
        f"{plan.world_size} ranks on {len(plan.nodes)} node(s): showing the lines of rank(s) "
        f"{rollup.rank_set(detail)} and, of the others, warnings and errors once per distinct text "
        "(--ranks selects other ranks; --log_dir keeps every line of every rank)"
    )


class RichConsole:
    """A terminal: colours, a live per-rank panel, rich tables."""

    def __init__(self, *, ranks: frozenset[int] | None = None) -> None:
        from rich.console import Console

        self.ranks = ranks
        self.console = Console(highlight=False)
        self.plan: LaunchPlan | None = None
        self.states: Sequence[RankState] = ()
        self._live: Any = None
        self._styles: dict[int, str] = {}
        self._prefixes: dict[int, str] = {}
        self.detail_max_ranks = DETAIL_MAX_RANKS
        self._large: _LargeJob | None = None
        self._next_panel = 0.0

    def begin(self, plan: LaunchPlan, states: Sequence[RankState]) -> None:
        from rich.live import Live

        self._t0 = time.monotonic()
        self.plan = plan
        self.states = states
        self._prefixes = _prefixes(plan, states)
        self._styles = {s.rank: _COLOURS[s.rank % len(_COLOURS)] for s in states}
        self.note(
            f"run {plan.run_id}: {plan.world_size} rank(s) on {plan.device} ({plan.backend}), "
            f"master {plan.master_addr}:{plan.master_port}: {plan.target.display()}"
        )
        self._large = None
        self._next_panel = 0.0
        if plan.world_size > self.detail_max_ranks:
            self._large = _LargeJob(plan, states, self.ranks)
            self.note(_large_note(plan, self._large.detail))
        self._live = Live(self._panel(), console=self.console, refresh_per_second=2, transient=True)
        self._live.start()

    def _panel(self) -> Any:
        if self._large is not None:
            return self._node_panel(self._large)
        from rich.table import Table
        from rich.text import Text

        counts = Counter(s.state for s in self.states)
        elapsed = time.monotonic() - self._t0
        caption = ", ".join(f"{n} {state}" for state, n in counts.items()) + f" | {elapsed:.0f} s"
        table = Table(box=None, pad_edge=False, header_style="bold", expand=False, caption=caption,
                      caption_justify="left")
        for col in ("rank", "state", "pid", "GPU alloc/reserved/peak", "RSS", "progress"):
            table.add_column(col)
        for s in self.states:
            style = self._styles.get(s.rank, "")
            table.add_row(
                # Text, not markup: a `[host:3]` prefix would read as a style tag.
                Text(self._prefixes.get(s.rank, str(s.rank)), style=style),
                s.state if s.returncode is None else _exit_cell(s),
                str(s.pid or "-"),
                _gpu_cell(s),
                format_bytes(s.rss),
                _step_cell(s),
            )
        return table

    def _node_panel(self, large: _LargeJob) -> Any:
        """One row per node, the most interesting first (failed ranks, then the slowest), as
        many as the terminal has room for; the job's roll-up as the caption."""
        from rich.table import Table

        rows, job = large.rows()
        room = max(5, self.console.size.height - 8)
        shown = rollup.interesting_first(rows)[:room]
        caption = _rollup_text(job) + f" | {time.monotonic() - self._t0:.0f} s"
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

    def output(self, lines: Sequence[RankOutput]) -> None:
        from rich.text import Text

        if self._large is not None:
            lines = self._large.split(lines)
        text = Text()
        for line in lines:
            if self._large is None and self.ranks is not None and line.rank not in self.ranks:
                continue
            style = self._styles.get(line.rank, "")
            text.append(self._prefixes.get(line.rank, f"[{line.rank}]"), style=style)
            text.append(" " if line.stream == "stdout" else "! ", style=style)
            text.append(line.text + "\n", style="dim" if line.stream == "stderr" else "")
        if text:
            text.rstrip()
            self.console.print(text, soft_wrap=True)

    def note(self, text: str, *, level: Literal["info", "warn", "error"] = "info") -> None:
        from rich.markup import escape

        style = {"info": "bold", "warn": "bold yellow", "error": "bold red"}[level]
        self.console.print(f"[{style}]zerorun:[/] {escape(text)}", markup=True, highlight=False)

    def refresh(self) -> None:
        now = time.monotonic()
        if self._large is not None:
            for line in self._large.dedup.due(now):
                self.console.print(line, markup=False, highlight=False, style="yellow")
        if self._live is not None and now >= self._next_panel:
            # The panel is O(ranks) to build: at most every _PANEL_EVERY_S, not every batch.
            self._next_panel = now + _PANEL_EVERY_S
            self._live.update(self._panel())

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def end(self, result: JobResult) -> None:
        from rich.panel import Panel
        from rich.table import Table

        self.stop()
        if self._large is not None:
            for line in self._large.dedup.due(0.0, flush=True):
                self.console.print(line, markup=False, highlight=False, style="yellow")
        if result.exit_code != 0:
            from rich.text import Text

            body = Text("\n".join(failure_lines(result)))
            self.console.print(Panel(body, title="[bold red]job failed", border_style="red", expand=False))
        tables = [("summary", summary_rows(result))]
        if self._large is not None:
            self.console.print("\n".join(large_summary_lines(result)), markup=False, highlight=False)
            detail = replace(result, ranks=[s for s in result.ranks if s.rank in self._large.detail])
            tables = [("memory by component", breakdown_rows(detail))]
        else:
            tables.append(("memory by component", breakdown_rows(result)))
        for title, (head, rows) in tables:
            if not rows:
                continue
            table = Table(title=title, title_justify="left")
            for h in head:
                table.add_column(h)
            for row in rows:
                table.add_row(*row)
            self.console.print(table)
        colour = "green" if result.exit_code == 0 else "red"
        self.console.print(f"[{colour}]zerorun: exit code {result.exit_code}[/] after {result.wall_s:.1f} s")
