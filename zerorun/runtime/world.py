"""Which rank this process is and where rank 0 is, from whichever launcher started it (stdlib
only: the shim uses it before torch is imported).

Sources, first found wins: the torchrun variables (what zerorun's launcher sets, Contract 2),
Open MPI (OMPI_COMM_WORLD_*), PMIx (PMIX_RANK / PMIX_SIZE / PMIX_LOCAL_RANK where a launcher
exports them), Slurm (`srun`: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, unless an MPI's own
rank variables disagree: then srun started the MPI's daemons, not this process), MPICH / Intel
MPI / Cray PALS (PMI_RANK / PMI_SIZE, MPI_LOCALRANKID or PMI_LOCAL_RANK), the PMIx server
(asked, `runtime/pmix.py`, when a launcher exports only PMIX_RANK and PMIX_NAMESPACE, as
`prterun` does), and nothing at all (a single process).

The master (MASTER_ADDR / MASTER_PORT): set by zerorun and torchrun; under srun the job's first
node and a port from the job id; under an mpirun the user started on several hosts, rank 0's
host name as the PMIx server knows it and a port from the job's namespace; one host needs only
loopback. Otherwise the user is asked to export MASTER_ADDR.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from zerorun.errors import RuntimeConfigError
from zerorun.runtime import pmix

__all__ = ["World", "world", "int_env", "rank_env", "rendezvous_address", "first_slurm_host", "torchrun_env"]

PmixQuery = Callable[[Mapping[str, str]], "pmix.PmixJob | None"]

# (name, rank, size, local rank candidates, local size candidates), innermost launcher first: an
# mpirun (or MPICH's mpiexec) inside a Slurm allocation starts its daemons with srun, and the
# ranks inherit the daemon's SLURM_PROCID/SLURM_NTASKS (its node's index, the node count), which
# are not theirs; Open MPI's and PMIx's own variables are.
_SOURCES: tuple[tuple[str, str, str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("torchrun", "RANK", "WORLD_SIZE", ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",),
     ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    ("pmix", "PMIX_RANK", "PMIX_SIZE", ("PMIX_LOCAL_RANK",), ("PMIX_LOCAL_SIZE",)),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",), ()),
    ("pmi", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"), ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")),
)  # fmt: skip


def _slurm_is_outer(env: Mapping[str, str]) -> bool:
    """srun started this process's launcher, not this process: a PMIx server other than Slurm's
    own (whose namespaces are `slurm.pmix.JOB.STEP`) started it (PRRTE inside an allocation), or
    MPICH's PMI variables disagree with SLURM_PROCID/SLURM_NTASKS (hydra inside an allocation).
    Under `srun --mpi=pmix/pmi2` Slurm's (with SLURM_LOCALID) are used."""
    if pmix.is_client(env) and not env["PMIX_NAMESPACE"].startswith("slurm.pmix."):
        return True
    slurm = (env.get("SLURM_PROCID"), env.get("SLURM_NTASKS"))
    return env.get("PMI_RANK") is not None and (env.get("PMI_RANK"), env.get("PMI_SIZE", slurm[1])) != slurm


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int | None  # None: the source does not say
    source: str  # "torchrun", "slurm", "openmpi", "pmix", "pmi" or "none"


def int_env(env: Mapping[str, str], name: str) -> int | None:
    """`env[name]` as an integer; None when unset or empty; a clear error when not a number."""
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise RuntimeConfigError(f"environment variable {name}={value!r} is not an integer") from None


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        value = int_env(env, name)
        if value is not None:
            return value
    return None


def world(env: Mapping[str, str], query: PmixQuery = pmix.job) -> World:
    """This process's place in its job, from whichever launcher started it."""
    for source, rank_var, size_var, local_vars, local_size_vars in _SOURCES:
        rank, size = int_env(env, rank_var), int_env(env, size_var)
        if source == "slurm" and _slurm_is_outer(env):
            continue
        if rank is not None and size is not None:
            local = _first(env, local_vars)
            if local is None:
                local = int_env(env, "LOCAL_RANK") or 0
            return World(rank, size, local, _first(env, local_size_vars), source)
    if pmix.is_client(env):
        # A PMIx launcher that exports only PMIX_RANK and PMIX_NAMESPACE: its server knows the rest.
        job = query(env)
        if job is not None:
            return World(job.rank, job.size, job.local_rank, job.local_size, "pmix")
    return World(0, 1, 0, None, "none")


def rank_env(env: Mapping[str, str], query: PmixQuery = pmix.job) -> tuple[int, int, int]:
    """(rank, world_size, local_rank); (0, 1, 0) if no launcher started us."""
    w = world(env, query)
    return w.rank, w.size, w.local_rank


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'gpu[03-04,07],cpu1' -> 'gpu03'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if m is None:
        raise RuntimeConfigError(f"cannot read the Slurm node list {nodelist!r}: export MASTER_ADDR")
    prefix, ranges = m.group(1), m.group(2)
    return prefix if not ranges else prefix + ranges.split(",")[0].split("-")[0]


def _job_port(key: str) -> str:
    """A port from a job's identity: concurrent jobs on one host do not collide on one default."""
    number = int(key) if key.isdigit() else zlib.crc32(key.encode())
    return str(20000 + number % 20000)


def rendezvous_address(env: Mapping[str, str], world_size: int, query: PmixQuery = pmix.job) -> tuple[str, str]:
    """(MASTER_ADDR, MASTER_PORT) for env:// rendezvous."""
    addr, port = env.get("MASTER_ADDR") or None, env.get("MASTER_PORT") or None
    if world(env, query).source == "slurm":
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if addr is None and nodelist:
            addr = first_slurm_host(nodelist)
        if port is None and env.get("SLURM_JOB_ID", "").isdigit():
            port = _job_port(env["SLURM_JOB_ID"])
    if addr is None and world_size > 1:
        local_size = world(env, query).local_size
        if local_size is None:
            local_size = _first(env, tuple(name for source in _SOURCES for name in source[4]))
        job = None
        if pmix.is_client(env) and local_size != world_size:  # asked only when it can matter
            job = query(env)
            if local_size is None and job is not None:
                local_size = job.local_size
        if local_size is not None and local_size != world_size:
            # Ranks on several hosts, started by the user's own mpirun: rank 0's host is the master.
            addr = job.rank0_host if job is not None else None
            if addr is None:
                raise RuntimeConfigError(
                    "ranks run on several hosts but MASTER_ADDR is not set"
                    + (" and the PMIx server could not tell rank 0's host" if pmix.is_client(env) else "")
                    + ": export MASTER_ADDR=<host of rank 0> (and MASTER_PORT) to every rank (mpirun -x MASTER_ADDR), "
                    "or start the job with zerorun or torchrun"
                )
    if port is None and pmix.is_client(env):
        port = _job_port(env["PMIX_NAMESPACE"])
    return addr or "127.0.0.1", port or "29500"


def torchrun_env(env: Mapping[str, str], query: PmixQuery = pmix.job) -> dict[str, str]:
    """The torchrun variables for a rank another launcher started (srun, mpirun), so a script
    written for torchrun (`init_process_group()` from the environment) runs unchanged; {} when
    they are already set or there is one process only."""
    if env.get("RANK") is not None:
        return {}
    w = world(env, query)
    if w.source == "none" or w.size <= 1:
        return {}
    addr, port = rendezvous_address(env, w.size, query)
    out = {
        "RANK": str(w.rank),
        "WORLD_SIZE": str(w.size),
        "LOCAL_RANK": str(w.local_rank),
        "MASTER_ADDR": addr,
        "MASTER_PORT": port,
    }
    if w.local_size is not None:
        out["LOCAL_WORLD_SIZE"] = str(w.local_size)
    return out
