"""Process group and device for this rank, from the launcher's environment or anyone else's.

Understands, in order: the torchrun variables (what zerorun's launcher sets, Contract 2), Slurm
(``srun``: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID), Open MPI (OMPI_COMM_WORLD_*), MPICH /
Intel MPI (PMI_RANK / PMI_SIZE), and nothing at all (a single process). A process group that the
script already created is used as it is.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from zerorun.errors import RuntimeConfigError

__all__ = ["DistContext", "init_distributed", "rank_env", "rendezvous_address", "first_slurm_host"]

_SOURCES = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    group: dist.ProcessGroup | None = None


def _int_env(name: str, env: Mapping[str, str] | None = None) -> int | None:
    value = (os.environ if env is None else env).get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise RuntimeConfigError(f"environment variable {name}={value!r} is not an integer") from None


def rank_env(env: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from whichever launcher started us; (0, 1, 0) if none."""
    for rank_var, size_var, local_var in _SOURCES:
        rank, size = _int_env(rank_var, env), _int_env(size_var, env)
        if rank is not None and size is not None:
            local = _int_env(local_var, env)
            if local is None:
                local = _int_env("LOCAL_RANK", env) or 0
            return rank, size, local
    return 0, 1, 0


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'gpu[03-04,07],cpu1' -> 'gpu03'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if m is None:
        raise RuntimeConfigError(f"cannot read the Slurm node list {nodelist!r}: export MASTER_ADDR")
    prefix, ranges = m.group(1), m.group(2)
    return prefix if not ranges else prefix + ranges.split(",")[0].split("-")[0]


def rendezvous_address(env: Mapping[str, str], world_size: int) -> tuple[str, str]:
    """(MASTER_ADDR, MASTER_PORT) for env:// rendezvous. torchrun and zerorun set both; under
    srun they come from the job's node list and id; one host needs no more than loopback."""
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if "SLURM_PROCID" in env and "RANK" not in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if addr is None and nodelist:
            addr = first_slurm_host(nodelist)
        if port is None and env.get("SLURM_JOB_ID", "").isdigit():
            port = str(20000 + int(env["SLURM_JOB_ID"]) % 20000)  # distinct jobs, distinct ports
    if addr is None:
        local_size = env.get("LOCAL_WORLD_SIZE") or env.get("OMPI_COMM_WORLD_LOCAL_SIZE")
        if world_size > 1 and local_size is not None and int(local_size) != world_size:
            raise RuntimeConfigError(
                "ranks run on several hosts but MASTER_ADDR is not set: export MASTER_ADDR=<host of rank 0> "
                "(and MASTER_PORT) before starting the job, or start it with zerorun or torchrun"
            )
        addr = "127.0.0.1"
    return addr, port or "29500"


def _device(local_rank: int) -> torch.device:
    wanted = os.environ.get("ZERORUN_DEVICE")
    if wanted == "cpu" or not torch.cuda.is_available():
        if wanted == "cuda":
            raise RuntimeConfigError("ZERORUN_DEVICE=cuda but torch sees no CUDA device on this host")
        return torch.device("cpu")
    per_gpu = _int_env("ZERORUN_RANKS_PER_GPU") or 1
    index = local_rank // max(per_gpu, 1)
    if index >= torch.cuda.device_count():
        raise RuntimeConfigError(
            f"local rank {local_rank} maps to GPU {index} (ranks per GPU: {per_gpu}) but this host has "
            f"{torch.cuda.device_count()} GPU(s): start fewer ranks per node or raise --ranks_per_gpu"
        )
    return torch.device("cuda", index)


def init_distributed() -> DistContext:
    """Create the default process group if none exists; return this rank's context."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = _int_env("LOCAL_RANK")
        if local is None:
            local = rank_env()[2]
        device = _device(local)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return DistContext(rank, world, local, device, str(dist.get_backend()), None)

    rank, world, local = rank_env()
    device = _device(local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = os.environ.get("ZERORUN_BACKEND") or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise RuntimeConfigError("ZERORUN_BACKEND=nccl needs a CUDA device; use gloo on CPU")
    timeout_s = _int_env("ZERORUN_PG_TIMEOUT") or 1800
    timeout = timedelta(seconds=timeout_s)
    if world == 1 and "MASTER_ADDR" not in os.environ:
        # One process and no rendezvous address: a private in-memory store, no port needed.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        addr, port = rendezvous_address(os.environ, world)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, port
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=device if backend == "nccl" else None,
        )
    return DistContext(rank, world, local, device, backend, None)
