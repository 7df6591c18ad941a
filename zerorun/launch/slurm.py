"""Nodes of a Slurm allocation: one `srun` starts a node agent on every node; each agent dials
back to the launcher over TCP and speaks the SSH agents' protocol (`launch/wire.py`).

    srun --nodes=N --ntasks=N --ntasks-per-node=1 --cpu-bind=none --kill-on-bad-exit=1
         --nodelist=HOSTS --chdir=CWD [--overlap] [--slurm_args ...] PYTHON -u -m zerorun.launch.agent --dial

Slurm tracks, accounts for and kills what srun started; zerorun adds the console, fail-fast,
heartbeats and events exactly as over SSH (`agent_runner.AgentRunner` drives each agent). srun
broadcasts stdin and merges every task's stdout, so each agent has its own TCP connection:
`ZERORUN_AGENT_DIAL` (the launcher's addresses and port; the agent tries
SLURM_LAUNCH_NODE_IPADDR first) and `ZERORUN_AGENT_TOKEN` (a per-job secret) travel in srun's
environment, never on a command line. Stopping: the agents stop their ranks (fail-fast,
Ctrl-C, grace period, as over SSH), then srun gets SIGTERM (one SIGINT only makes srun print
status); with no task left, Slurm kills whatever srun started.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from zerorun.errors import LaunchError
from zerorun.launch.slurm_env import SlurmEnv, compress_hostlist

__all__ = ["srun_command", "salloc_command", "prepare", "allocation_hosts"]


def srun_command(
    nodes: Sequence[str],
    *,
    python: str,
    cwd: str,
    in_step: bool,
    slurm_args: str | None = None,
) -> list[str]:
    """The one srun that starts every node's agent (argv, no shell)."""
    n = len(nodes)
    argv = [
        "srun",
        f"--nodes={n}",
        f"--ntasks={n}",
        "--ntasks-per-node=1",
        "--cpu-bind=none",
        "--kill-on-bad-exit=1",
        f"--nodelist={compress_hostlist(list(nodes))}",
        f"--chdir={cwd}",
        "--job-name=zerorun-agents",
    ]
    if in_step:
        argv.append("--overlap")  # inside a step, share its resources rather than wait for them
    if slurm_args:
        try:
            argv += shlex.split(slurm_args)
        except ValueError as err:
            raise LaunchError(f"--slurm_args {slurm_args!r}: {err}.") from None
    return [*argv, python, "-u", "-m", "zerorun.launch.agent", "--dial"]


def prepare(
    plan: Any,
    options: Any,
    slurm: SlurmEnv,
    *,
    withheld: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> tuple[Any, list[Any]]:
    """Start the agents with srun (`launch/dialin.py`: they dial back, the SSH preflight runs over
    their links, the environment srun hands them is built there), return the plan with the
    master the ranks will use and one runner per node."""
    from zerorun.launch.dialin import DialSetup, prepare_dialed

    def command(setup: DialSetup) -> list[str]:
        return srun_command(
            setup.names, python=setup.python, cwd=setup.cwd, in_step=slurm.in_step, slurm_args=options.slurm_args
        )

    return prepare_dialed(
        plan,
        options,
        command=command,
        node_of=lambda node, names: node if node in names else None,
        withheld=withheld,
        environ=environ,
        # Ranks per node: --num_gpus if given, else the node's GPUs, else SLURM_TASKS_PER_NODE.
        ranks_from_gpus=options.num_gpus is None,
    )


def allocation_hosts(slurm: SlurmEnv, *, num_gpus: int | None, k: int = 1) -> list[Any]:
    """The allocation's nodes as hosts: ranks per node from --num_gpus if given, else
    SLURM_TASKS_PER_NODE (never SLURM_JOB_CPUS_PER_NODE, which counts CPUs)."""
    from zerorun.launch.hosts import Host

    if not slurm.nodes:
        raise LaunchError("inside a Slurm allocation, but SLURM_JOB_NODELIST is not set: cannot tell its nodes.")
    counts = slurm.tasks_per_node if slurm.tasks_per_node and len(slurm.tasks_per_node) == len(slurm.nodes) else None
    hosts = []
    for i, name in enumerate(slurm.nodes):
        if num_gpus is not None:
            slots = -(-num_gpus // k)
        elif counts is not None:
            slots = counts[i]
        else:
            slots = 1
        hosts.append(Host(name, tuple(range(slots)), origin=f"Slurm job {slurm.job_id}"))
    return hosts


def salloc_command(
    *, num_nodes: int | None, gpus_per_node: int | None, slurm_args: str | None, inner: Sequence[str]
) -> list[str]:
    """`--launcher slurm` outside an allocation (a login node): salloc obtains one and runs the
    same zerorun command inside it. `--slurm_args` (partition, time, account) go to salloc too."""
    if num_nodes is None:
        raise LaunchError(
            "--launcher slurm outside an allocation obtains one with salloc: say how many nodes with "
            "--num_nodes N (and --gpus_per_node G), or run inside salloc/sbatch (`zerorun sbatch ...`)."
        )
    argv = ["salloc", f"--nodes={num_nodes}"]
    if gpus_per_node is not None:
        argv += [f"--gpus-per-node={gpus_per_node}", f"--ntasks-per-node={gpus_per_node}"]
    if slurm_args:
        try:
            argv += shlex.split(slurm_args)
        except ValueError as err:
            raise LaunchError(f"--slurm_args {slurm_args!r}: {err}.") from None
    return [*argv, *inner]
