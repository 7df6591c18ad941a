"""Per-node mode: a scheduler starts one zerorun per node (Kubernetes PyTorchJob/JobSet, an
indexed Job, `srun --ntasks-per-node=1` inside a batch script, any "run this on every node").

`resolve(...)` turns the command line and the environment into a `PerNodeSpec`, pure; the
nodes then meet through `launch/rendezvous.py` and each runs its own ranks. Where each value
comes from, first found wins:

| value | command line | PyTorchJob / torchrun env | indexed Job | inside `srun` |
|---|---|---|---|---|
| node count | `--nnodes` | `PET_NNODES` (`N` or `N:N`) | | `SLURM_STEP_NUM_NODES` / `SLURM_NNODES` |
| node rank | `--node_rank` | `PET_NODE_RANK` | `JOB_COMPLETION_INDEX` | `SLURM_NODEID` |
| ranks per node | `--num_gpus`/`--nproc_per_node` | `PET_NPROC_PER_NODE` (`auto`/`gpu`: the node's GPUs) | | |
| master address | `--master_addr` | `PET_MASTER_ADDR`, `MASTER_ADDR` | | the step's first node |
| master port | `--master_port` | `PET_MASTER_PORT`, `MASTER_PORT` | | 20000 + 2 x (job id mod 10000) |

The node count never comes from `WORLD_SIZE` (a PyTorchJob sets it to pods x processes per pod).
The rendezvous listens on node 0 at `--rdzv_port`, default the master port + 1 (the ranks' own
rendezvous store uses the master port).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerorun.errors import LaunchError
from zerorun.launch.slurm_env import SlurmEnv

__all__ = ["PerNodeSpec", "resolve", "DEFAULT_MASTER_PORT", "DEFAULT_RDZV_TIMEOUT_S"]

DEFAULT_MASTER_PORT = 29500
DEFAULT_RDZV_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class PerNodeSpec:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    rdzv_port: int
    # Ranks on this node; None: the node's GPUs (or the CPU default without GPUs).
    nproc: int | None
    rdzv_timeout: float
    # Where the values came from, for the console's first line.
    source: str


def _int(name: str, raw: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not a whole number.") from None
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and at most {maximum}" if maximum is not None else ""
        raise LaunchError(f"{name}={raw!r} must be at least {minimum}{upper}.")
    return value


def _nnodes_from_pet(raw: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", raw)
    if not m:
        raise LaunchError(f"PET_NNODES={raw!r} is not a node count (N, or N:N).")
    lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
    if lo != hi:
        raise LaunchError(
            f"PET_NNODES={raw!r} is an elastic range; zerorun runs a fixed number of nodes. Set "
            "minReplicas = maxReplicas (or pass --nnodes)."
        )
    if lo < 1:
        raise LaunchError(f"PET_NNODES={raw!r} must be at least 1.")
    return lo


def _nproc_from_pet(raw: str) -> int | None:
    value = raw.strip().lower()
    if value in ("auto", "gpu"):
        return None
    if value == "cpu":
        raise LaunchError("PET_NPROC_PER_NODE=cpu is not supported: give a number of ranks (or auto).")
    return _int("PET_NPROC_PER_NODE", raw, minimum=1)


def resolve(
    *,
    nnodes: int | None,
    node_rank: int | None,
    master_addr: str | None,
    master_port: int | None,
    rdzv_port: int | None,
    nproc: int | None,
    rdzv_timeout: float | None,
    environ: Mapping[str, str],
    slurm: SlurmEnv | None = None,
) -> PerNodeSpec:
    """Command line first, then PET_* (PyTorchJob, torchrun's variables), JOB_COMPLETION_INDEX,
    then a Slurm step's variables. Raises LaunchError naming what is missing or malformed."""
    sources: list[str] = []
    step = slurm if slurm is not None and slurm.in_step else None

    if nnodes is None and environ.get("PET_NNODES"):
        nnodes = _nnodes_from_pet(environ["PET_NNODES"])
        sources.append(f"PET_NNODES={environ['PET_NNODES']}")
    if nnodes is None and step is not None:
        nnodes = step.step_num_nodes or (len(step.step_nodes) or None) or step.num_nodes
        if nnodes is not None:
            sources.append(f"Slurm step of {nnodes} node(s)")
    if nnodes is None:
        raise LaunchError(
            "per-node mode needs the number of nodes: pass --nnodes N (or set PET_NNODES, as a "
            "PyTorchJob does). WORLD_SIZE is not used: it counts processes, not nodes."
        )
    if nnodes < 1:
        raise LaunchError(f"--nnodes {nnodes} must be at least 1.")

    if node_rank is None and environ.get("PET_NODE_RANK"):
        node_rank = _int("PET_NODE_RANK", environ["PET_NODE_RANK"])
        sources.append(f"PET_NODE_RANK={node_rank}")
    if node_rank is None and environ.get("JOB_COMPLETION_INDEX"):
        node_rank = _int("JOB_COMPLETION_INDEX", environ["JOB_COMPLETION_INDEX"])
        sources.append(f"JOB_COMPLETION_INDEX={node_rank}")
    if node_rank is None and step is not None and step.node_id is not None:
        node_rank = step.node_id
        sources.append(f"SLURM_NODEID={node_rank}")
    if node_rank is None:
        raise LaunchError(
            f"per-node mode needs this node's rank (0-{nnodes - 1}): pass --node_rank R (or set "
            "PET_NODE_RANK, or run as an indexed Job: JOB_COMPLETION_INDEX)."
        )
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"node rank {node_rank} is not between 0 and {nnodes - 1} (--nnodes {nnodes}).")

    if step is not None and step.ntasks is not None and nnodes > 1 and step.ntasks != nnodes:
        raise LaunchError(
            f"this Slurm step runs {step.ntasks} task(s) on {nnodes} node(s); zerorun runs once per node "
            "and starts the ranks itself: srun --ntasks-per-node=1 zerorun ..."
        )

    if master_addr is None:
        for name in ("PET_MASTER_ADDR", "MASTER_ADDR"):
            if environ.get(name):
                master_addr = environ[name].strip()
                sources.append(f"{name}={master_addr}")
                break
    if master_addr is None and step is not None and (step.step_nodes or step.nodes):
        master_addr = (step.step_nodes or step.nodes)[0]
        sources.append(f"master {master_addr} (the step's first node)")
    if master_addr is None:
        if nnodes == 1:
            master_addr = "127.0.0.1"
        else:
            raise LaunchError(
                "per-node mode needs the master's address (node 0, reachable from every node): pass "
                "--master_addr HOST (or set PET_MASTER_ADDR / MASTER_ADDR)."
            )

    if master_port is None:
        for name in ("PET_MASTER_PORT", "MASTER_PORT"):
            if environ.get(name):
                master_port = _int(name, environ[name], minimum=1, maximum=65534)
                break
    if master_port is None and step is not None and step.job_id is not None and step.job_id.isdigit():
        master_port = 20000 + 2 * (int(step.job_id) % 10000)
    if master_port is None:
        master_port = DEFAULT_MASTER_PORT
    if rdzv_port is None:
        rdzv_port = master_port + 1
    if rdzv_port == master_port:
        raise LaunchError(
            f"--rdzv_port {rdzv_port} is the ranks' master port; zerorun's rendezvous needs a port of its own."
        )

    if nproc is None and environ.get("PET_NPROC_PER_NODE"):
        nproc = _nproc_from_pet(environ["PET_NPROC_PER_NODE"])
    timeout = DEFAULT_RDZV_TIMEOUT_S if rdzv_timeout is None else float(rdzv_timeout)
    if timeout <= 0:
        raise LaunchError(f"--rdzv_timeout {rdzv_timeout} must be positive (seconds).")
    return PerNodeSpec(
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        rdzv_port=rdzv_port,
        nproc=nproc,
        rdzv_timeout=timeout,
        source=", ".join(sources) if sources else "--nnodes/--node_rank",
    )


# --- the glue the launch pipeline calls ---------------------------------------------------------


def provisional_hosts(spec: PerNodeSpec, local_slots: int) -> list[Any]:
    """Hosts for planning before the nodes met (`--dry-run`): every node like this one."""
    from zerorun.launch.hosts import Host

    return [Host(f"node{r}", tuple(range(local_slots)), origin=f"node rank {r}") for r in range(spec.nnodes)]


def prepare(plan: Any, options: Any, spec: PerNodeSpec, devices: Any) -> tuple[Any, list[Any]]:
    """Meet the other nodes (`launch/rendezvous.py`), then the plan of the whole cluster (each
    node's own rank count and device, the global ranks in node order) and the runners: this
    node's ranks, and a stand-in for every other node. Nothing starts before every node met."""
    from dataclasses import replace

    from zerorun.launch import rendezvous
    from zerorun.launch.agent import port_in_use
    from zerorun.launch.hosts import Host
    from zerorun.launch.local import LocalRunner
    from zerorun.launch.plan import NodePlan, RankSpec, default_omp_threads

    k = plan.ranks_per_gpu
    own = plan.nodes[spec.node_rank]
    nproc = len(own.ranks)
    device = plan.device
    if device == "cuda" and not devices.gpus:
        raise LaunchError(f"the job runs on cuda, but node {spec.node_rank} has no visible GPU; pass --device cpu.")

    def port_check() -> str | None:
        if port_in_use(spec.master_port):
            return (
                f"the ranks' master port {spec.master_port} is already in use on node 0 (another job?); "
                "pick another with --master_port."
            )
        return None

    session = rendezvous.meet(
        rendezvous.local_info(spec.node_rank, nproc, device, len(devices.gpus)),
        nnodes=spec.nnodes,
        master_addr=spec.master_addr,
        rdzv_port=spec.rdzv_port,
        timeout=spec.rdzv_timeout,
        run_id=plan.run_id,
        master_port_check=port_check,
    )
    try:
        nodes = []
        rank = 0
        cuda = session.device == "cuda"
        for info, name in zip(session.nodes, session.host_names(), strict=True):
            slots = -(-info.nproc // k) if cuda else info.nproc
            host = Host(name, tuple(range(slots)), origin=f"node rank {info.node_rank}")
            specs = tuple(
                RankSpec(rank + local, local, info.node_rank, name, local // k if cuda else None) for local in range(info.nproc)
            )
            rank += info.nproc
            visible = tuple(str(s) for s in range(slots)) if cuda else None
            nodes.append(NodePlan(info.node_rank, host, specs, visible, dict(own.env)))
        plan = replace(
            plan,
            # Each node's processes carry their own run id: the kill sweep of one node's runner
            # must never reach another node's ranks (two nodes may share a machine in tests).
            run_id=f"{session.run_id}-n{spec.node_rank}",
            nodes=tuple(nodes),
            world_size=rank,
            device=session.device,
            backend="nccl" if cuda and k == 1 else "gloo",
            master_addr=spec.master_addr,
            master_port=spec.master_port,
            omp_threads={spec.node_rank: default_omp_threads(devices.cores, nproc)},
        )
        plan = rendezvous.own_node_devices(plan, spec.node_rank, devices.gpus)
        return plan, session.runners(plan, LocalRunner(plan, plan.nodes[spec.node_rank]))
    except BaseException:
        session.close()
        raise
