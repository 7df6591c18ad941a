"""`zerorun compat install | uninstall | status`: this virtual environment's `import deepspeed`
and `deepspeed` command become zerorun's (zerorun/compat/venv_install.py), and back."""

from __future__ import annotations

import typer

from zerorun.cli.errors import report_errors
from zerorun.errors import ZerorunError

__all__ = ["app"]

app = typer.Typer(add_completion=False, no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]})


class CompatInstallError(ZerorunError):
    """A refused `zerorun compat` change (the message says why and what to do)."""


def _run(action: str) -> None:
    from zerorun.compat import venv_install

    try:
        lines = getattr(venv_install, action)()
    except venv_install.InstallError as err:
        raise CompatInstallError(str(err)) from None
    for line in lines:
        typer.echo(line)


@app.command()
@report_errors
def install() -> None:
    """Make `import deepspeed` and the `deepspeed` command in this virtual environment zerorun's."""
    _run("install")


@app.command()
@report_errors
def uninstall() -> None:
    """Remove what `zerorun compat install` wrote (the same as `pip uninstall deepspeed`)."""
    _run("uninstall")


@app.command()
@report_errors
def status() -> None:
    """Say whether the layer is installed here and whether a real DeepSpeed is."""
    _run("status")
