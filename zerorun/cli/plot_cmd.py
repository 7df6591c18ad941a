"""`zerorun plot RUN_DIR [-o FILE.png]`: a run's loss, learning rate, throughput and memory as a
PNG (zerorun.plot). matplotlib is an optional extra, imported only here, only when drawing."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from zerorun.cli.errors import report_errors

__all__ = ["app"]

app = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)


@app.command()
@report_errors
def plot(
    run_dir: Annotated[Path, typer.Argument(help="The launcher's --log_dir, or a csv_monitor output directory.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="PNG file to write.")] = Path("zerorun-run.png"),
    title: Annotated[str | None, typer.Option("--title", help="Figure title.")] = None,
) -> None:
    """Plot a run: loss, learning rate, tokens/s, per-rank memory, memory by component, timers."""
    from zerorun.plot.figure import render
    from zerorun.plot.runs import read_run

    run = read_run(run_dir)
    path = render(run, output, title=title)
    typer.echo(f"wrote {path} ({len(run.loss)} loss points, {len(run.memory)} rank(s) of memory)")
