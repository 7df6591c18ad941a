"""``deepspeed.comm``: process-group set-up and collectives (torch.distributed underneath).

``init_distributed`` creates the process group the way ``zerorun.initialize`` does (the
launcher's torchrun variables, Slurm or MPI environments, or one process), so a script or
accelerate calling it first and ``deepspeed.initialize`` later share one group. The
collectives are torch.distributed's, with DeepSpeed's signatures; DeepSpeed's logging-only
arguments (``prof``, ``log_name``, ``debug``) are accepted and have no effect.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zerorun.compat.deepspeed._surface import module_getattr
from zerorun.errors import RuntimeConfigError

__all__ = [
    "ReduceOp",
    "init_distributed",
    "is_initialized",
    "is_available",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "get_global_rank",
    "get_backend",
    "barrier",
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce",
    "send",
    "recv",
    "new_group",
    "destroy_process_group",
]

ReduceOp = dist.ReduceOp
__getattr__ = module_getattr(__name__)


def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Create the default process group unless one exists.

    The backend is zerorun's choice for this rank (``ZERORUN_BACKEND``: gloo when several ranks
    share a GPU, where NCCL cannot run), whatever ``dist_backend`` asks for; ``timeout`` applies
    when the launcher set none. Explicit ``rank``/``world_size`` fill the environment when no
    launcher did."""
    del auto_mpi_discovery, verbose, config, dist_backend
    if is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeConfigError(
            "deepspeed.init_distributed(dist_init_required=False) but no process group exists: create one "
            "with torch.distributed.init_process_group first, or leave dist_init_required unset"
        )
    if init_method not in (None, "env://"):
        raise RuntimeConfigError(
            f"deepspeed.init_distributed(init_method={init_method!r}): zerorun rendezvous through the "
            "environment (env://, MASTER_ADDR/MASTER_PORT); leave init_method unset"
        )
    if rank >= 0 and world_size > 0 and "RANK" not in os.environ:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    if timeout is not None and "ZERORUN_PG_TIMEOUT" not in os.environ:
        os.environ["ZERORUN_PG_TIMEOUT"] = str(int(timeout.total_seconds()))
    from zerorun.runtime.distributed import init_distributed as _init

    _init()


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_backend(group: Any = None) -> str:
    return str(dist.get_backend(group))


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, **_logging: Any) -> Any:
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **_logging: Any
) -> Any:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, **_logging: Any) -> Any:
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False, **_logging: Any
) -> Any:
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def _new_or_old(new: str, old: str) -> Any:
    # torch 2.13 renamed the flat-tensor collectives (the old names warn); 2.11 has only the old.
    return getattr(dist, new, None) or getattr(dist, old)


def all_gather_into_tensor(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None, async_op: bool = False, **_logging: Any
) -> Any:
    fn = _new_or_old("all_gather_single", "all_gather_into_tensor")
    return fn(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    **_logging: Any,
) -> Any:
    fn = _new_or_old("reduce_scatter_single", "reduce_scatter_tensor")
    return fn(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def reduce(
    tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **_logging: Any
) -> Any:
    return dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **_logging: Any) -> Any:
    return dist.send(tensor, dst=dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, **_logging: Any) -> Any:
    return dist.recv(tensor, src=src, group=group, tag=tag)


def new_group(ranks: list[int] | None = None, **kwargs: Any) -> Any:
    return dist.new_group(ranks=ranks, **kwargs)


def destroy_process_group(group: Any = None) -> None:
    dist.destroy_process_group(group)
