"""Turning `ZerorunError` into a message and an exit code: the one place this happens."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from zerorun.errors import ZerorunError

__all__ = ["report_errors", "print_error"]

P = ParamSpec("P")
R = TypeVar("R")


def print_error(err: ZerorunError) -> None:
    """Print a user error as a red panel on stderr (plain text when stderr is not a TTY)."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.text import Text

    console = Console(stderr=True, highlight=False)
    title = type(err).__name__
    if console.is_terminal:
        # Text, not markup: a message may hold brackets (`[host]:2222`, a path `[/x]`), which
        # markup would take for style tags (or fail on, with a traceback).
        console.print(Panel(Text(str(err)), title=f"[bold red]{title}", border_style="red", expand=False))
    else:
        # Whole lines (no wrapping at an assumed 80 columns): logs keep a failure table intact.
        console.print(f"error ({title}): {err}", markup=False, soft_wrap=True)


def report_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator for command bodies: ZerorunError -> message + exit code, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except ZerorunError as err:
            print_error(err)
            sys.exit(err.exit_code)

    return wrapper
