"""Which launcher runs a job: `--launcher {auto,local,ssh,slurm,mpi,pernode}` (or
`launcher.launcher` in the config), and why. Pure: options + environment in, a choice out.

`auto`, first rule that applies:
1. `--nnodes` or `--node_rank` given -> `pernode`;
2. inside a Slurm step with several tasks (`SLURM_STEP_ID` set, `SLURM_NTASKS` > 1: a batch
   script running `srun -N2 --ntasks-per-node=1 zerorun ...`) -> `pernode`, from `SLURM_NODEID`
   and `SLURM_NNODES`;
3. `PET_NNODES` set (a Kubernetes PyTorchJob; torchrun's variables) -> `pernode`;
4. inside a Slurm allocation but not a step (`SLURM_JOB_ID` set, more than one node: `salloc -N2`
   or a batch script) -> `slurm`;
5. a hostfile -> `ssh`;
6. otherwise `local` (this machine).
A one-task Slurm step (`srun -N1 zerorun ...`) is `local`: this node only. `mpi` (Open MPI's
mpirun starts the node agents of a hostfile) is only ever chosen explicitly, and so is `sim`:
the hostfile's nodes simulated on this machine (real agents, synthetic ranks; what the
console, logs and fail-fast of a large job look like: `launch/simulate.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from zerorun.errors import LaunchError
from zerorun.launch.slurm_env import SlurmEnv, read_slurm_env

__all__ = ["LAUNCHERS", "Launcher", "LauncherChoice", "choose_launcher"]

Launcher = Literal["local", "ssh", "slurm", "mpi", "pernode", "sim"]
LAUNCHERS: tuple[str, ...] = ("auto", "local", "ssh", "slurm", "mpi", "pernode", "sim")


@dataclass(frozen=True)
class LauncherChoice:
    launcher: Launcher
    reason: str
    slurm: SlurmEnv

    def line(self) -> str:
        """The console's first line."""
        return f"launcher {self.launcher}: {self.reason}"


def choose_launcher(
    requested: str | None,
    *,
    hostfile: str | None,
    nnodes: int | None,
    node_rank: int | None,
    environ: Mapping[str, str],
) -> LauncherChoice:
    """Raises LaunchError for an unknown name, a malformed SLURM_* value, or a request that
    cannot work (`slurm` outside an allocation, `ssh`/`mpi` without a hostfile)."""
    want = (requested or "auto").strip().lower()
    if want not in LAUNCHERS:
        raise LaunchError(f"--launcher {requested!r} is not one of {', '.join(LAUNCHERS)}.")
    slurm = read_slurm_env(environ) if any(k.startswith("SLURM_") for k in environ) else SlurmEnv()

    if want != "auto":
        reason = "--launcher " + want
        if want in ("ssh", "mpi", "sim") and hostfile is None:
            raise LaunchError(f"--launcher {want} needs --hostfile (the nodes to start on).")
        if want == "slurm" and not slurm.in_allocation:
            raise LaunchError(
                "--launcher slurm runs inside a Slurm allocation (SLURM_JOB_ID is not set here): start "
                "it from `salloc -N<nodes>` or a batch script (`zerorun sbatch ...` writes one); the zerorun "
                "command obtains one itself with --num_nodes N."
            )
        if want == "local" and (nnodes not in (None, 1) or hostfile is not None):
            raise LaunchError("--launcher local runs on this machine only; leave out --hostfile/--nnodes.")
        return LauncherChoice(want, reason, slurm)  # type: ignore[arg-type]

    if nnodes is not None or node_rank is not None:
        given = " ".join(
            f"--{name} {value}" for name, value in (("nnodes", nnodes), ("node_rank", node_rank)) if value is not None
        )
        return LauncherChoice("pernode", f"auto: {given} given (one zerorun per node)", slurm)
    if slurm.in_step and (slurm.ntasks or 1) > 1:
        return LauncherChoice(
            "pernode",
            f"auto: inside Slurm step {slurm.job_id}.{slurm.step_id} with {slurm.ntasks} tasks "
            f"(node {slurm.node_id} of {slurm.step_num_nodes or slurm.num_nodes})",
            slurm,
        )
    if environ.get("PET_NNODES"):
        return LauncherChoice("pernode", f"auto: PET_NNODES={environ['PET_NNODES']} (PyTorchJob)", slurm)
    if slurm.in_allocation and not slurm.in_step and (slurm.num_nodes or len(slurm.nodes)) > 1:
        return LauncherChoice(
            "slurm",
            f"auto: inside Slurm allocation {slurm.job_id} of {slurm.num_nodes or len(slurm.nodes)} nodes "
            "(--launcher ssh to use a hostfile instead)",
            slurm,
        )
    if hostfile is not None:
        return LauncherChoice("ssh", f"auto: --hostfile {hostfile}", slurm)
    if slurm.in_step:
        return LauncherChoice("local", f"auto: a one-task Slurm step ({slurm.job_id}.{slurm.step_id}): this node", slurm)
    return LauncherChoice("local", "auto: no hostfile, scheduler or --nnodes: this machine", slurm)
