"""Command-line entry point: `zerorun [launch options] SCRIPT [ARGS...]` and subcommands.

This package is the only place that parses arguments and the only place that turns a
`ZerorunError` into an exit code and a message. It must not import torch at module level:
`zerorun --help` and `zerorun print-config` start fast and work without a GPU stack.

Dispatch: click cannot mix "a group of subcommands" with "a command whose first positional
argument is an arbitrary script path", so `main` looks at the first argument. A known
subcommand name goes to that subcommand's typer app; anything else is the launch command.
Each subcommand lives in its own module, imported only when used (the table: cli/commands.py).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from zerorun.cli.commands import ALIASES, SUBCOMMANDS

__all__ = ["main", "SUBCOMMANDS"]


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    first = ALIASES.get(args[0], args[0]) if args else None
    if first in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[first][0])
        module.app(args=args[1:], prog_name=f"zerorun {first}")
        return
    from zerorun.cli import launch_cmd

    launch_cmd.app(args=args, prog_name="zerorun")
