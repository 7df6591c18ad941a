"""Each node's device, from the node itself: the plan built on the launcher's machine (a login
node without GPUs, or a workstation with them) is re-planned from the GPUs every node's agent
reported in its preflight.

Pure: a plan and the GPU counts in, a plan out (or a LaunchError). Used by the transports that
have a preflight (`launch/remote.py` over SSH, `launch/dialin.py` for Slurm and MPI) when the
device was not fixed with `--device`:
- every remote node has GPUs -> cuda (nccl), each node's slots its GPU indices;
- no remote node has one -> cpu (gloo);
- some have, some not -> an error naming them (one job runs on one kind of device).
With `ranks_from_gpus` (Slurm without `--num_gpus`), a GPU node also gets one rank per GPU it
has, so global ranks are renumbered in node order. Nodes on the launcher's own machine keep
what the launcher saw.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from zerorun.errors import LaunchError

__all__ = ["adopt_node_devices"]


def adopt_node_devices(plan: Any, gpus: Mapping[str, int], *, ranks_from_gpus: bool = False) -> Any:
    """The plan with the device (and, with `ranks_from_gpus`, the rank count) each remote node
    reported; `gpus` maps host names to GPU counts (nodes missing there keep their part)."""
    from zerorun.launch.plan import NodePlan, RankSpec

    remote = [n for n in plan.nodes if not n.is_local and n.host.name in gpus]
    if not remote:
        return plan
    with_gpus = [n.host.name for n in remote if gpus[n.host.name] > 0]
    without = [n.host.name for n in remote if gpus[n.host.name] <= 0]
    if with_gpus and without:
        raise LaunchError(
            f"some nodes have GPUs ({', '.join(with_gpus)}) and some have none ({', '.join(without)}); one job "
            "runs on one kind of device. Leave the CPU nodes out (--exclude) or pass --device cpu."
        )
    device = "cuda" if with_gpus else "cpu"
    local_devices = {n.node_rank: n.ranks[0].gpu is not None for n in plan.nodes if n.is_local and n.ranks}
    if any(has_gpu != (device == "cuda") for has_gpu in local_devices.values()):
        raise LaunchError(
            f"the remote nodes run on {device} but this machine's ranks would not; pass --device to choose one."
        )
    if device == plan.device and not (ranks_from_gpus and device == "cuda"):
        return plan
    k = plan.ranks_per_gpu if device == "cuda" else 1
    if device == "cpu" and plan.ranks_per_gpu != 1:
        raise LaunchError(f"--ranks_per_gpu {plan.ranks_per_gpu} needs GPUs, but no node has one.")
    nodes = []
    rank = 0
    for node in plan.nodes:
        if node.is_local or node.host.name not in gpus:
            n_ranks = len(node.ranks)
            host = node.host
            visible = node.visible_devices
        else:
            host = node.host
            if ranks_from_gpus and device == "cuda":
                host = replace(host, slots=tuple(range(gpus[host.name])))
            n_ranks = len(host.slots) * k if ranks_from_gpus and device == "cuda" else len(node.ranks)
            visible = tuple(str(s) for s in host.slots) if device == "cuda" else None
        specs = tuple(
            RankSpec(rank + local, local, node.node_rank, host.name, (local // k) if device == "cuda" else None)
            for local in range(n_ranks)
        )
        rank += n_ranks
        nodes.append(NodePlan(node.node_rank, host, specs, visible, node.env))
    return replace(
        plan,
        nodes=tuple(nodes),
        world_size=rank,
        device=device,
        backend="nccl" if device == "cuda" and k == 1 else "gloo",
    )
