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

What the rows, tables and summaries say is `launch/console_format.py`; this module decides
what is shown when and writes it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import IO, Any, Literal

from zerorun.launch import console_format as fmt
from zerorun.launch import rollup
from zerorun.launch.messages import RankLines, RankOutput
from zerorun.launch.plan import LaunchPlan
from zerorun.launch.result import JobResult, RankState

# What the consoles print: runs of a rank's lines (a `RankOutput` is a run of one line).
Run = RankLines | RankOutput

__all__ = [
    "PlainConsole",
    "RichConsole",
    "make_console",
    "DETAIL_MAX_RANKS",
]

_COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "bright_red", "bright_cyan", "bright_magenta")
# Above this many ranks the console shows the large-job view (module docstring).
DETAIL_MAX_RANKS = 128
# The live panel is rebuilt at most this often (the supervisor calls refresh() every batch).
_PANEL_EVERY_S = 0.5
# On a terminal, rank lines are printed at most this often (or once this many are waiting): each
# print also redraws the live panel (~1.4 ms), which at the supervisor's batch sizes (tens of
# lines when a rank prints fast) cost ~70 us of launcher CPU per line.
_PRINT_EVERY_S = 0.025
_PRINT_LINES = 2000


# What rich's Text removes from printed text (bell, backspace, vertical tab, form feed, `\r`).
_STRIP_CONTROL = dict.fromkeys((7, 8, 11, 12, 13))


class _Raw:
    """Text already carrying its escape codes, written as it is: rich neither parses, wraps nor
    crops it (a live panel is still moved below it)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.segment import Segment

        yield Segment(self.text)


def make_console(*, ranks: frozenset[int] | None = None, force_plain: bool = False) -> PlainConsole | RichConsole:
    if not force_plain and sys.stdout.isatty():
        return RichConsole(ranks=ranks)
    return PlainConsole(ranks=ranks)


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

    def split(self, runs: Sequence[Run]) -> list[Run]:
        """The runs to print as they are (the detail ranks'); every notable line goes to the dedup."""
        now = time.monotonic()
        shown: list[Run] = []
        for run in runs:
            if not run.lines:
                continue
            self.last_lines[self.node_of.get(run.rank, -1)] = run.lines[-1]
            if run.rank in self.detail:
                shown.append(run)
            # A detail rank's warning counts too: the line for everyone then names every rank.
            # A run is searched whole first (no keyword spans a line break): lines one by one
            # only in a run that has a notable line.
            lines = run.lines
            if len(lines) > 1 and not rollup.is_notable("\n".join(lines)):
                continue
            for text in lines:
                if rollup.is_notable(text):
                    self.dedup.add(run.rank, text, now)
        return shown

    def rows(self) -> tuple[list[rollup.NodeRow], rollup.JobRollup]:
        rows = rollup.node_rows(self.states, self.hosts, self.last_lines)
        return rows, rollup.job_rollup(rows, self.states)

    def status_line(self) -> str:
        _, job = self.rows()
        return fmt.rollup_text(job)


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
        self._prefixes = fmt.prefixes(plan, states)
        self.note(
            f"run {plan.run_id}: {plan.world_size} rank(s) on {plan.device} ({plan.backend}), "
            f"master {plan.master_addr}:{plan.master_port}: {plan.target.display()}"
        )
        if plan.world_size > self.detail_max_ranks:
            self._large = _LargeJob(plan, states, self.ranks)
            self._next_status = time.monotonic() + self.status_interval_s
            self.note(fmt.large_note(plan, self._large.detail))

    def output(self, runs: Sequence[Run]) -> None:
        if self._large is not None:
            runs = self._large.split(runs)
        current: IO[str] | None = None
        chunk: list[str] = []
        for run in runs:
            if (self._large is None and self.ranks is not None and run.rank not in self.ranks) or not run.lines:
                continue
            stream = self.err if run.stream == "stderr" else self.out
            if stream is not current:
                if current is not None and chunk:
                    self._write(current, "".join(chunk))
                current, chunk = stream, []
            # A run is one join: no Python work per line.
            head = f"{self._prefixes.get(run.rank, f'[{run.rank}]')} "
            chunk.append(head + f"\n{head}".join(run.lines) + "\n")
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
            parts.append("zerorun: FAILED\n" + "".join(f"  {line}\n" for line in fmt.failure_lines(result)))
        if self._large is not None:
            lines = fmt.large_summary_lines(result)
            parts.append("zerorun: summary\n" + "".join(f"  {line}\n" for line in lines))
            result = replace(result, ranks=[s for s in result.ranks if s.rank in self._large.detail])
        else:
            head, rows = fmt.summary_rows(result)
            parts.append("zerorun: summary\n" + "".join(f"  {line}\n" for line in fmt.table_text(head, rows)))
        bhead, brows = fmt.breakdown_rows(result)
        if brows:
            parts.append(
                "zerorun: memory by component (last report)\n"
                + "".join(f"  {line}\n" for line in fmt.table_text(bhead, brows))
            )
        parts.append(f"zerorun: exit code {result.exit_code} after {result.wall_s:.1f} s\n")
        self._write(self.err, "".join(parts))


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
        self._heads: dict[tuple[int, str], str] = {}
        self._dim = ("", "")
        self._pending: list[str] = []  # rendered lines not printed yet
        self._stopped = False
        self._pending_lines = 0
        self._printed_at = 0.0

    def begin(self, plan: LaunchPlan, states: Sequence[RankState]) -> None:
        from rich.live import Live
        from rich.text import Text

        self._t0 = time.monotonic()
        self._stopped = False
        self.plan = plan
        self.states = states
        self._prefixes = fmt.prefixes(plan, states)
        self._styles = {s.rank: _COLOURS[s.rank % len(_COLOURS)] for s in states}
        # Escape codes rendered once, before the live panel starts (a capture while it runs
        # would catch the panel too): each rank's coloured prefix per stream, and the codes
        # around a stderr line (empty strings on a terminal without colours).
        self._heads = {
            (s.rank, stream): self._render(Text(self._prefixes[s.rank] + tail, style=self._styles[s.rank]))
            for s in states
            for stream, tail in (("stdout", " "), ("stderr", "! "))
        }
        before, _, after = self._render(Text("\0", style="dim")).partition("\0")
        self._dim = (before, after)
        self.note(
            f"run {plan.run_id}: {plan.world_size} rank(s) on {plan.device} ({plan.backend}), "
            f"master {plan.master_addr}:{plan.master_port}: {plan.target.display()}"
        )
        self._large = None
        self._next_panel = 0.0
        if plan.world_size > self.detail_max_ranks:
            self._large = _LargeJob(plan, states, self.ranks)
            self.note(fmt.large_note(plan, self._large.detail))
        self._live = Live(self._panel(), console=self.console, refresh_per_second=2, transient=True)
        self._live.start()

    def _panel(self) -> Any:
        elapsed = time.monotonic() - self._t0
        if self._large is not None:
            rows, job = self._large.rows()
            room = max(5, self.console.size.height - 8)
            return fmt.node_table(rows, job, room, elapsed)
        return fmt.rank_table(self.states, self._prefixes, self._styles, elapsed)

    def output(self, runs: Sequence[Run]) -> None:
        # The hot path: no rich Text per line (spans, control-code stripping, rendering cost
        # ~50 us of launcher CPU per line), and no Python work per line either: each rank's
        # coloured prefix and the stderr style are rendered once (`_heads`), a run of lines is
        # one join and one translate, a batch one string printed as it is.
        if self._large is not None:
            runs = self._large.split(runs)
        heads, dim_open, dim_close = self._heads, self._dim[0], self._dim[1]
        parts: list[str] = []
        count = 0
        for run in runs:
            if (self._large is None and self.ranks is not None and run.rank not in self.ranks) or not run.lines:
                continue
            head = heads.get((run.rank, run.stream)) or f"[{run.rank}] "
            if run.stream != "stdout":
                head, tail = head + dim_open, dim_close + "\n"
            else:
                tail = "\n"
            # The control codes go from the lines' text only (not from the escape codes around it).
            text = "\n".join(run.lines).translate(_STRIP_CONTROL)
            parts.append(head + text.replace("\n", tail + head) + tail)
            count += len(run.lines)
        if parts:
            self._pending.append("".join(parts))
            self._pending_lines += count
            # After stop() nothing refreshes any more (a start failure drains the runners'
            # last lines after stopping the display): print at once.
            if self._pending_lines >= _PRINT_LINES or self._stopped:
                self._print_pending()

    def _print_pending(self) -> None:
        """Print the lines waiting (refresh, note, stop, and a full batch call this)."""
        if self._pending:
            text, self._pending, self._pending_lines = "".join(self._pending), [], 0
            self.console.print(_Raw(text), soft_wrap=True)
        self._printed_at = time.monotonic()

    def _render(self, text: Any) -> str:
        with self.console.capture() as capture:
            self.console.print(text, end="", soft_wrap=True)
        return capture.get()

    def note(self, text: str, *, level: Literal["info", "warn", "error"] = "info") -> None:
        from rich.markup import escape

        style = {"info": "bold", "warn": "bold yellow", "error": "bold red"}[level]
        self._print_pending()  # the rank lines before it come first
        self.console.print(f"[{style}]zerorun:[/] {escape(text)}", markup=True, highlight=False)

    def refresh(self) -> None:
        now = time.monotonic()
        if self._pending and now - self._printed_at >= _PRINT_EVERY_S:
            self._print_pending()
        if self._large is not None:
            due = self._large.dedup.due(now)
            if due:
                self._print_pending()
            for line in due:
                self.console.print(line, markup=False, highlight=False, style="yellow")
        if self._live is not None and now >= self._next_panel:
            # The panel is O(ranks) to build: at most every _PANEL_EVERY_S, not every batch.
            self._next_panel = now + _PANEL_EVERY_S
            self._live.update(self._panel())

    def stop(self) -> None:
        self._stopped = True
        self._print_pending()
        if self._live is not None:
            self._live.stop()
            self._live = None

    def end(self, result: JobResult) -> None:
        from rich.panel import Panel

        self.stop()
        if self._large is not None:
            for line in self._large.dedup.due(0.0, flush=True):
                self.console.print(line, markup=False, highlight=False, style="yellow")
        if result.exit_code != 0:
            from rich.text import Text

            body = Text("\n".join(fmt.failure_lines(result)))
            self.console.print(Panel(body, title="[bold red]job failed", border_style="red", expand=False))
        tables = [("summary", fmt.summary_rows(result))]
        if self._large is not None:
            self.console.print("\n".join(fmt.large_summary_lines(result)), markup=False, highlight=False)
            detail = replace(result, ranks=[s for s in result.ranks if s.rank in self._large.detail])
            tables = [("memory by component", fmt.breakdown_rows(detail))]
        else:
            tables.append(("memory by component", fmt.breakdown_rows(result)))
        for title, (head, rows) in tables:
            if rows:
                self.console.print(fmt.result_table(title, head, rows))
        colour = "green" if result.exit_code == 0 else "red"
        self.console.print(f"[{colour}]zerorun: exit code {result.exit_code}[/] after {result.wall_s:.1f} s")
