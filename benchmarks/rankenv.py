"""This rank's place in the job: rank, world, device, backend, and the process group.

Reads the torchrun variables (which the zerorun launcher sets too, docs/architecture.md
Contract 2), so a worker runs the same under `zerorun`, `torchrun` or the harness's own
single-process spawn. The harness creates the process group itself, before any peer or
`zerorun.initialize` runs, so every configuration gets the same backend and timeout
(`zerorun.initialize` only creates one when none exists).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RankContext", "rank_context", "init_process_group", "gather_objects", "synchronize"]


@dataclass(frozen=True)
class RankContext:
    rank: int
    local_rank: int
    world_size: int
    ranks_per_gpu: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_context(device_pref: str = "auto", ranks_per_gpu: int | None = None) -> RankContext:
    """The context from the environment. `device_pref`: auto (cuda if available), cuda or cpu.

    Ranks sharing a GPU (`ranks_per_gpu` K > 1, or ZERORUN_RANKS_PER_GPU from the launcher)
    use GPU LOCAL_RANK // K and gloo: NCCL refuses two ranks on one device.
    """
    env = os.environ
    rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    local_rank = int(env.get("LOCAL_RANK", "0"))
    k = ranks_per_gpu or int(env.get("ZERORUN_RANKS_PER_GPU", "1") or 1)
    if device_pref == "auto":
        device_pref = env.get("ZERORUN_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_pref == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
        device = torch.device("cuda", local_rank // k)
        torch.cuda.set_device(device)
        backend = env.get("ZERORUN_BACKEND") or ("gloo" if k > 1 else "nccl")
    elif device_pref == "cpu":
        device, backend = torch.device("cpu"), "gloo"
    else:
        raise ValueError(f"unknown device {device_pref!r}: use auto, cuda or cpu")
    # Tell zerorun what was decided (docs/architecture.md Contract 2), as its launcher would:
    # under torchrun nothing else says that ranks share a GPU or that --device cpu was asked
    # for, and zerorun.initialize would otherwise pick GPU LOCAL_RANK or CUDA.
    env["ZERORUN_DEVICE"] = device.type
    env["ZERORUN_BACKEND"] = backend
    env["ZERORUN_RANKS_PER_GPU"] = str(k)
    return RankContext(rank, local_rank, world, k, device, backend)


def init_process_group(ctx: RankContext, timeout_s: float) -> None:
    """Create the default process group (env:// rendezvous) unless one exists."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(
        ctx.backend, rank=ctx.rank, world_size=ctx.world_size, timeout=timedelta(seconds=timeout_s)
    )


def gather_objects(ctx: RankContext, obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (just [obj] without a process group)."""
    if not dist.is_initialized() or ctx.world_size == 1:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work. This is a host-device sync point, on purpose: step
    times are measured between two of them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
