"""Process group and device for this rank, from the launcher's environment or anyone else's.

Which rank and where rank 0 is come from `runtime/world.py` (torchrun's variables, srun,
Open MPI, PMIx, MPICH / Intel MPI, or a single process). A process group that the script
already created is used as it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from zerorun.errors import RuntimeConfigError
from zerorun.runtime.world import first_slurm_host, int_env, rank_env, rendezvous_address

__all__ = ["DistContext", "init_distributed", "rank_env", "rendezvous_address", "first_slurm_host"]


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    group: dist.ProcessGroup | None = None


def _device(local_rank: int) -> torch.device:
    wanted = os.environ.get("ZERORUN_DEVICE")
    if wanted == "cpu" or not torch.cuda.is_available():
        if wanted == "cuda":
            raise RuntimeConfigError("ZERORUN_DEVICE=cuda but torch sees no CUDA device on this host")
        return torch.device("cpu")
    per_gpu = int_env(os.environ, "ZERORUN_RANKS_PER_GPU") or 1
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
        local = int_env(os.environ, "LOCAL_RANK")
        if local is None:
            local = rank_env(os.environ)[2]
        device = _device(local)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return DistContext(rank, world, local, device, str(dist.get_backend()), None)

    rank, world, local = rank_env(os.environ)
    device = _device(local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = os.environ.get("ZERORUN_BACKEND") or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise RuntimeConfigError("ZERORUN_BACKEND=nccl needs a CUDA device; use gloo on CPU")
    timeout_s = int_env(os.environ, "ZERORUN_PG_TIMEOUT") or 1800
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
