"""Nodes of a hostfile started by Open MPI: one `mpirun` starts a node agent on every node; each
agent dials back to the launcher over TCP (`launch/dialin.py`) and speaks the SSH agents'
protocol, so the console, fail-fast, heartbeats and events are those of an SSH job.

    mpirun -np N --map-by ppr:1:node -H host1:1,host2:1,... --bind-to none -wdir CWD
           -x ZERORUN_AGENT_DIAL -x ZERORUN_AGENT_TOKEN [-x PYTHONPATH] [--mpi_args ...]
           PYTHON -u -m zerorun.launch.agent --dial

`-x NAME` forwards the launcher's value of NAME (the secret token never appears on a command
line). mpirun reaches the nodes its own way (ssh through `plm_rsh_agent`, or the resource
manager inside an allocation); agent i is MPI rank i, on the hostfile's i-th selected host.
Stopping: the agents stop their ranks, then mpirun gets SIGTERM, which removes its remote
daemons and anything left (~1 s).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from zerorun.errors import LaunchError

__all__ = ["mpirun_command", "prepare"]


def mpirun_command(
    hosts: Sequence[str],
    *,
    python: str,
    cwd: str,
    mpi_args: str | None = None,
    as_root: bool = False,
    forward: Sequence[str] = (),
) -> list[str]:
    """The one mpirun that starts every node's agent (argv, no shell)."""
    argv = [
        "mpirun",
        "-np", str(len(hosts)),
        "--map-by", "ppr:1:node",
        "-H", ",".join(f"{h}:1" for h in hosts),
        "--bind-to", "none",
        "-wdir", cwd,
    ]  # fmt: skip
    if as_root:
        argv.append("--allow-run-as-root")  # Open MPI refuses root without it (containers)
    for name in ("ZERORUN_AGENT_DIAL", "ZERORUN_AGENT_TOKEN", *forward):
        argv += ["-x", name]
    if mpi_args:
        try:
            argv += shlex.split(mpi_args)
        except ValueError as err:
            raise LaunchError(f"--mpi_args {mpi_args!r}: {err}.") from None
    return [*argv, python, "-u", "-m", "zerorun.launch.agent", "--dial"]


def prepare(
    plan: Any,
    options: Any,
    *,
    withheld: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> tuple[Any, list[Any]]:
    """Start the agents with mpirun, run the preflight over their links; the plan with the
    master the ranks will use and one runner per node (`launch/dialin.py`, which builds the
    environment mpirun runs with). Remote ranks start from their node's environment plus the
    job's layers (`node.env`), as over SSH."""
    from zerorun.launch.dialin import DialSetup, prepare_dialed

    if any(n.is_local for n in plan.nodes):
        raise LaunchError(
            "--launcher mpi starts every node through mpirun; a `localhost` line in the hostfile is not a "
            "node mpirun can address the same way. Name this machine by its host name (or use --launcher ssh)."
        )

    def command(setup: DialSetup) -> list[str]:
        forward = [name for name in ("PYTHONPATH",) if setup.env.get(name)]
        return mpirun_command(
            setup.names, python=setup.python, cwd=setup.cwd, mpi_args=options.mpi_args, as_root=os.geteuid() == 0,
            forward=forward,
        )  # fmt: skip

    def node_of(mpi_rank: str, names: Sequence[str]) -> str | None:
        return names[int(mpi_rank)] if mpi_rank.isdigit() and int(mpi_rank) < len(names) else None

    return prepare_dialed(plan, options, command=command, node_of=node_of, withheld=withheld, environ=environ)
