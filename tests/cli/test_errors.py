"""cli/errors.py: a user error is printed whole, never as a traceback."""

from __future__ import annotations

import pytest

from zerorun.cli.errors import print_error
from zerorun.errors import LaunchError

# A failure table (launch/fanout.py) with the brackets real messages carry: `[addr]:port`
# known_hosts names, a path in brackets (markup would take `[/etc]` for a closing tag).
TABLE = (
    "SSH failed on 2 nodes: 1 host key, 1 unreachable\n"
    "  node   problem      what                                          fix\n"
    "  node1  host key     host key of node1 ([10.0.0.1]:2222) is not in known_hosts  `ssh-keyscan -p 2222 10.0.0.1`\n"
    "  node2  unreachable  cannot reach node2 [/etc/hosts]: no answer within 2 s  Check the name.\n"
    "Nothing was started."
)


def test_on_a_terminal_the_panel_shows_brackets_as_written(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich: a terminal
    monkeypatch.setenv("COLUMNS", "200")
    print_error(LaunchError(TABLE))  # before: MarkupError (closing tag '[/etc/hosts]'), a traceback
    err = capsys.readouterr().err
    assert "LaunchError" in err and "[/etc/hosts]" in err and "([10.0.0.1]:2222)" in err


def test_without_a_terminal_lines_are_not_wrapped(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setenv("TERM", "dumb")
    print_error(LaunchError(TABLE))
    err = capsys.readouterr().err
    # every row of the table on its own line, however wide (rich wrapped at 80 columns)
    assert err.splitlines() == ["error (LaunchError): " + TABLE.splitlines()[0], *TABLE.splitlines()[1:]]
