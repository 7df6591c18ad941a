"""The zerorun error hierarchy.

The library raises these with the fix in the message; only `zerorun.cli` turns them into
exit codes and rich panels. Nothing here imports anything of ours.
"""

from __future__ import annotations

__all__ = [
    "ZerorunError",
    "ConfigError",
    "HostfileError",
    "LaunchError",
    "RankFailure",
    "RuntimeConfigError",
    "CheckpointError",
]


class ZerorunError(Exception):
    """Base of every error zerorun reports to users (no traceback is shown for these)."""

    exit_code: int = 1


class ConfigError(ZerorunError):
    """A config file or value is invalid; the message names the file, key and the fix."""


class HostfileError(ZerorunError):
    """A hostfile or host selector is invalid; the message names the file and line."""


class LaunchError(ZerorunError):
    """A job could not be started (bad script, busy port, unreachable host, ...)."""


class RankFailure(ZerorunError):
    """A rank of a running job failed; carries the launcher's exit code."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class RuntimeConfigError(ZerorunError):
    """The runtime was initialized with something it cannot use (open `auto`, bad optimizer, ...)."""


class CheckpointError(ZerorunError):
    """A checkpoint is missing, incomplete or incompatible."""
