"""The launcher's tuning variables (``ZERORUN_*`` in the launcher's own environment), read in one
place: a value that is not a number is a `LaunchError` naming the variable, not a traceback.

- ``ZERORUN_HEARTBEAT_TIMEOUT`` (alias ``ZERORUN_SSH_HEARTBEAT_TIMEOUT``, the older name):
  seconds without a heartbeat before a node counts as lost -- every transport (SSH, Slurm/MPI
  dial-in, per-node rendezvous, the simulation) reads it here. Default 10, at least 1.
- ``ZERORUN_SSH_PARALLELISM``: SSH connections opened at once (default 32).
- ``ZERORUN_SSH_CONNECT_TIMEOUT``: seconds per SSH connect (default: ~/.ssh/config, else 10).
- ``ZERORUN_AGENT_START_TIMEOUT`` (alias ``ZERORUN_SLURM_START_TIMEOUT``): seconds the agents
  started by srun/mpirun get to dial in (default 60).

Stdlib only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from zerorun.errors import LaunchError

__all__ = ["env_number", "heartbeat_timeout", "DEFAULT_HEARTBEAT_TIMEOUT_S"]

DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0


def env_number(
    names: tuple[str, ...],
    default: float | None,
    *,
    minimum: float = 0.0,
    integer: bool = False,
    environ: Mapping[str, str] | None = None,
) -> float | None:
    """The first of `names` set (non-empty) in the environment, as a number no smaller than
    `minimum`; `default` when none is set. Raises LaunchError for a value that is not one."""
    env = os.environ if environ is None else environ
    for name in names:
        raw = env.get(name, "").strip()
        if not raw:
            continue
        try:
            value: float = int(raw) if integer else float(raw)
        except ValueError:
            kind = "a whole number" if integer else "a number of seconds"
            raise LaunchError(f"{name}={raw!r} is not {kind}; unset it or give e.g. {name}={default or 1:g}.") from None
        if not value >= minimum:  # also catches nan
            raise LaunchError(f"{name}={raw!r} is below its minimum of {minimum:g}.")
        return value
    return default


def heartbeat_timeout(environ: Mapping[str, str] | None = None) -> float:
    """Seconds without a heartbeat before a node (or the launcher, seen from an agent) counts
    as lost."""
    value = env_number(
        ("ZERORUN_HEARTBEAT_TIMEOUT", "ZERORUN_SSH_HEARTBEAT_TIMEOUT"),
        DEFAULT_HEARTBEAT_TIMEOUT_S,
        minimum=1.0,
        environ=environ,
    )
    assert value is not None
    return value
