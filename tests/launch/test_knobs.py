"""launch/knobs.py: the launcher's ZERORUN_* tuning variables, one reader, clear errors."""

from __future__ import annotations

import pytest

from zerorun.errors import LaunchError
from zerorun.launch.knobs import env_number, heartbeat_timeout


def test_heartbeat_timeout_names_default_and_minimum() -> None:
    assert heartbeat_timeout({}) == 10.0
    assert heartbeat_timeout({"ZERORUN_SSH_HEARTBEAT_TIMEOUT": "5"}) == 5.0  # the older name
    assert heartbeat_timeout({"ZERORUN_HEARTBEAT_TIMEOUT": "3", "ZERORUN_SSH_HEARTBEAT_TIMEOUT": "5"}) == 3.0
    assert heartbeat_timeout({"ZERORUN_HEARTBEAT_TIMEOUT": ""}) == 10.0
    with pytest.raises(LaunchError, match="ZERORUN_HEARTBEAT_TIMEOUT='ten' is not a number of seconds"):
        heartbeat_timeout({"ZERORUN_HEARTBEAT_TIMEOUT": "ten"})
    with pytest.raises(LaunchError, match="below its minimum of 1"):
        heartbeat_timeout({"ZERORUN_SSH_HEARTBEAT_TIMEOUT": "0.1"})
    with pytest.raises(LaunchError, match="below its minimum"):
        heartbeat_timeout({"ZERORUN_HEARTBEAT_TIMEOUT": "nan"})


def test_env_number_whole_numbers() -> None:
    assert env_number(("N",), 32, minimum=1, integer=True, environ={"N": "8"}) == 8
    with pytest.raises(LaunchError, match="N='8.5' is not a whole number"):
        env_number(("N",), 32, minimum=1, integer=True, environ={"N": "8.5"})
    assert env_number(("N",), None, environ={}) is None


def test_the_ssh_options_read_the_variables_through_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A misspelt value used to end in a ValueError traceback from the launcher."""
    from zerorun.launch.plan import LaunchOptions, Target
    from zerorun.launch.remote import ssh_options_from

    opts = LaunchOptions(target=Target(script="t.py"))
    monkeypatch.setenv("ZERORUN_HEARTBEAT_TIMEOUT", "4")
    monkeypatch.setenv("ZERORUN_SSH_CONNECT_TIMEOUT", "2.5")
    ssh = ssh_options_from(opts)
    assert ssh.heartbeat_timeout_s == 4.0 and ssh.connect_timeout == 2.5
    monkeypatch.setenv("ZERORUN_SSH_PARALLELISM", "lots")
    with pytest.raises(LaunchError, match="ZERORUN_SSH_PARALLELISM"):
        ssh_options_from(opts)
