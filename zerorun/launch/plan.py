"""The launch plan: launch options + hosts -> every rank's identity, device and environment.

Pure: no processes, no sockets (the master port is chosen before and passed in), no torch.
Parsing stops at the edge: the CLI builds a `LaunchOptions`, `build_plan` turns it into a
`LaunchPlan`, and runners (`launch/local.py`, `launch/ssh.py`) start what the plan says.

Vocabulary: a *slot* is one place on a host as `launch.hosts` defines it (a GPU index, or one
CPU rank). With `ranks_per_gpu = K` a GPU slot carries K ranks; local rank `l` uses the
node's GPU `l // K` (the shim calls `torch.cuda.set_device`). `CUDA_VISIBLE_DEVICES` is set
per node, never per rank, so NCCL still sees the node's peers for P2P.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from zerorun.errors import LaunchError
from zerorun.launch.hosts import Host

__all__ = [
    "LaunchOptions",
    "Target",
    "RankSpec",
    "NodePlan",
    "LaunchPlan",
    "build_plan",
    "parse_visible_devices",
    "parse_rank_filter",
    "default_omp_threads",
    "new_run_id",
    "DeviceInfo",
    "local_slot_count",
]

Device = Literal["auto", "cuda", "cpu"]

# Default process-group timeout handed to `zerorun.initialize` (torch's gloo default is 30
# minutes: a hung job would sit that long before anything raised).
DEFAULT_PG_TIMEOUT_S = 600.0
DEFAULT_GRACE_S = 5.0
DEFAULT_CPU_RANKS = 2
# --save_on_preemption: Slurm's default KillWait and Kubernetes' default grace are both 30 s.
DEFAULT_PREEMPTION_GRACE_S = 25.0


@dataclass(frozen=True)
class Target:
    """What every rank runs: a script path or a module (`-m`), and its arguments verbatim."""

    script: str | None = None
    module: str | None = None
    args: tuple[str, ...] = ()

    def shim_argv(self, python: str = sys.executable) -> list[str]:
        """The rank's command line: the shim runs the target exactly as `python` would."""
        head = ["-m", self.module] if self.module else [str(self.script)]
        return [python, "-m", "zerorun.shim", *head, *self.args]

    def display(self) -> str:
        head = f"-m {self.module}" if self.module else str(self.script)
        return " ".join([head, *(shlex.quote(a) for a in self.args)])


@dataclass(frozen=True)
class LaunchOptions:
    """Every launch option, typed; `None` means "not given" (the config's `launcher:` section
    or the default applies). Built by `zerorun.cli.launch_cmd`, never from an argparse object."""

    target: Target
    num_gpus: int | None = None
    include: str | None = None
    exclude: str | None = None
    device: Device | None = None  # None: auto
    ranks_per_gpu: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    config: str | None = None
    log_dir: str | None = None
    dry_run: bool = False
    ranks: str | None = None  # console filter, e.g. "0" or "0,2-3"
    pg_timeout: float | None = None
    grace_period: float = DEFAULT_GRACE_S
    hang_timeout: float | None = None
    # multi-node
    hostfile: str | None = None
    num_nodes: int | None = None
    ssh_accept_new_hosts: bool = False
    ssh_parallelism: int | None = None  # connections opened at once (None: ZERORUN_SSH_PARALLELISM or 32)
    ssh_connect_timeout: float | None = None  # per node (None: ConnectTimeout from ~/.ssh/config, else 10 s)
    ssh_port: int | None = None  # every node's SSH port (None: Port from ~/.ssh/config, else 22)
    remote_python: str | None = None
    remote_cwd: str | None = None
    env: tuple[str, ...] = ()  # --env KEY=VAL / KEY, verbatim
    run_id: str | None = None
    pass_local_rank: bool = True  # to scripts that declare --local_rank (DeepSpeed style)
    # `import deepspeed` in the ranks is zerorun's layer; also `--local_rank=N` to every script
    # (DeepSpeed's launcher behaviour). None: not given (the config's launcher section decides).
    deepspeed_compat: bool | None = None
    # clusters (docs/clusters.md): which launcher (None: auto, see launch/selection.py), per-node
    # mode's node count/rank and rendezvous, options passed through to srun / mpirun.
    launcher: str | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    rdzv_port: int | None = None
    rdzv_timeout: float | None = None
    slurm_args: str | None = None
    gpus_per_node: int | None = None  # --launcher slurm outside an allocation: salloc --gpus-per-node
    mpi_args: str | None = None
    # fault tolerance (docs/fault-tolerance.md; launch/restart.py). None: not given.
    max_restarts: int | None = None  # attempts after the first (0: none)
    restart_on_any_failure: bool | None = None  # also retry a setup error raised on every rank
    resume_from: str | None = None  # the ranks load `latest` of this directory (ZERORUN_RESUME_FROM)
    save_on_preemption: bool | None = None  # SIGTERM: ranks save at the next step and exit 75
    preemption_grace: float | None = None  # seconds the ranks get for that (default 25)
    exclude_failed_nodes: bool | None = None  # leave lost / signal-killed nodes out of the next attempt
    min_nodes: int | None = None  # ... as long as this many remain (default 1)
    # Set by the restart loop on later attempts: the world size the job first ran at. An attempt
    # at another world size re-resolves the config's batch triad (config.batch.rebatch).
    batch_world_size: int | None = None

    # Fields the config's `launcher:` section may fill when the command line left them out.
    MERGEABLE = (
        "num_gpus", "num_nodes", "hostfile", "include", "exclude", "master_addr", "master_port",
        "device", "ranks_per_gpu", "pg_timeout", "hang_timeout", "log_dir", "deepspeed_compat",
        "launcher", "rdzv_timeout", "max_restarts", "restart_on_any_failure", "resume_from",
        "save_on_preemption", "preemption_grace", "exclude_failed_nodes", "min_nodes",
    )

    def merged(self, section: Mapping[str, object], *, base_dir: Path | None = None) -> LaunchOptions:
        """Fill what the command line left out from the config's `launcher:` section (only the
        keys the user set there). A relative `hostfile`/`log_dir` there is relative to the
        config file, as the schema documents."""
        updates: dict[str, object] = {}
        for name in self.MERGEABLE:
            value = section.get(name)
            if value is None or getattr(self, name) is not None:
                continue
            if name in ("hostfile", "log_dir", "resume_from") and base_dir is not None:
                value = str(base_dir / Path(str(value)).expanduser())
            updates[name] = value
        return replace(self, **updates)  # type: ignore[arg-type]

    @property
    def effective_ranks_per_gpu(self) -> int:
        """K: ranks that share one GPU (`ranks_per_gpu`, 1 when not given)."""
        return self.ranks_per_gpu or 1


@dataclass(frozen=True)
class RankSpec:
    """One rank's identity. `gpu` is the index into its node's CUDA_VISIBLE_DEVICES."""

    rank: int
    local_rank: int
    node_rank: int
    host: str
    gpu: int | None


@dataclass(frozen=True)
class NodePlan:
    """One node's part of a plan: its host, ranks and the variables set for the whole node."""

    node_rank: int
    host: Host
    ranks: tuple[RankSpec, ...]
    # CUDA_VISIBLE_DEVICES for this node (GPU jobs only).
    visible_devices: tuple[str, ...] | None
    # The job's extra variables for this node (env files, launcher.env, --env, per-host),
    # below the plan's own variables; see `launch.environment`.
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def is_local(self) -> bool:
        return self.host.is_local


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to start a job; `rank_env` gives the variables one rank gets."""

    run_id: str
    nodes: tuple[NodePlan, ...]
    world_size: int
    master_addr: str
    master_port: int
    device: Literal["cuda", "cpu"]
    backend: Literal["nccl", "gloo"]
    ranks_per_gpu: int
    pg_timeout: float
    target: Target
    config_path: str | None = None
    config_json: str | None = None
    cwd: str = field(default_factory=os.getcwd)
    # OMP_NUM_THREADS per node when the user has not set it (None: leave alone).
    omp_threads: Mapping[int, int] = field(default_factory=dict)
    # DeepSpeed's launcher passes `--local_rank=N` to every script; zerorun does when the
    # script declares that argument (None: the script does not, as with torchrun scripts).
    local_rank_arg: str | None = None
    # `import deepspeed` in the ranks is zerorun's compatibility layer (ZERORUN_DEEPSPEED_COMPAT).
    deepspeed_compat: bool = False
    # The device is each node's own, decided at start from what its preflight reports
    # (launch/node_devices.py); `device` is then the launcher machine's guess (`--dry-run` says so).
    device_per_node: bool = False
    # Fault tolerance (Contract 2): the directory whose `latest` the ranks load
    # (ZERORUN_RESUME_FROM), and SIGTERM = save and exit (ZERORUN_SAVE_ON_PREEMPTION).
    resume_from: str | None = None
    save_on_preemption: bool = False
    # With save_on_preemption: seconds the ranks get to save after SIGTERM (the supervisor's and
    # a node agent's deadline before SIGKILL); None otherwise.
    preemption_grace: float | None = None
    # A restart at another world size: the batch triad the ranks use instead of their config's
    # (ZERORUN_BATCH, JSON {"world_size", "train_batch_size", ...}; config.batch.rebatch).
    batch: str | None = None

    @property
    def ranks(self) -> list[RankSpec]:
        return [r for node in self.nodes for r in node.ranks]

    def rank_argv(self, spec: RankSpec, python: str = sys.executable) -> list[str]:
        """One rank's command line: the shim, the target, and `--local_rank=N` if wanted."""
        argv = self.target.shim_argv(python)
        if self.local_rank_arg is not None:
            argv.append(f"{self.local_rank_arg}={spec.local_rank}")
        return argv

    def with_master(self, addr: str | None = None, port: int | None = None) -> LaunchPlan:
        """Another master address/port (e.g. the address the other nodes can reach)."""
        return replace(self, master_addr=addr or self.master_addr, master_port=port or self.master_port)

    def rank_env(self, spec: RankSpec, event_fd: int | None = None) -> dict[str, str]:
        """The variables the plan sets for one rank (Contract 2); they override every other
        layer. The runner adds `ZERORUN_EVENT_FD` when it has opened the event channel."""
        node = self.nodes[spec.node_rank]
        env = {
            "RANK": str(spec.rank),
            "LOCAL_RANK": str(spec.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(len(node.ranks)),
            "GROUP_RANK": str(spec.node_rank),
            "GROUP_WORLD_SIZE": str(len(self.nodes)),
            "NODE_RANK": str(spec.node_rank),
            "ROLE_RANK": str(spec.rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "ZERORUN_DEVICE": self.device,
            "ZERORUN_BACKEND": self.backend,
            "ZERORUN_RANKS_PER_GPU": str(self.ranks_per_gpu),
            # Whole seconds: the runtime (and torchrun-style readers) parse an integer.
            "ZERORUN_PG_TIMEOUT": str(math.ceil(self.pg_timeout)),
            "ZERORUN_RUN_ID": self.run_id,
        }
        if node.visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(node.visible_devices)
        if self.config_json is not None:
            env["ZERORUN_CONFIG_JSON"] = self.config_json
        if self.config_path is not None:
            env["ZERORUN_CONFIG"] = self.config_path
        if event_fd is not None:
            env["ZERORUN_EVENT_FD"] = str(event_fd)
        if self.resume_from is not None:
            env["ZERORUN_RESUME_FROM"] = self.resume_from
        if self.save_on_preemption:
            env["ZERORUN_SAVE_ON_PREEMPTION"] = "1"
        if self.deepspeed_compat:
            env["ZERORUN_DEEPSPEED_COMPAT"] = "1"
        if self.batch is not None:
            env["ZERORUN_BATCH"] = self.batch
        return env

    def defaults_env(self, node_rank: int, base: Mapping[str, str]) -> dict[str, str]:
        """Defaults users otherwise set by hand, only where `base` (the rank's environment
        so far) does not already have them."""
        out: dict[str, str] = {}
        threads = self.omp_threads.get(node_rank)
        if threads is not None and "OMP_NUM_THREADS" not in base:
            out["OMP_NUM_THREADS"] = str(threads)
        return out


def new_run_id() -> str:
    import secrets
    import time

    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def default_omp_threads(cores: int, local_ranks: int) -> int:
    """torchrun sets 1 and warns; a better default shares the node's cores between ranks."""
    return max(1, cores // max(1, local_ranks))


def parse_visible_devices(value: str | None) -> tuple[str, ...] | None:
    """CUDA_VISIBLE_DEVICES -> its entries (indices or `GPU-<uuid>` / `MIG-...` ids), or None
    when unset. CUDA stops at the first invalid entry, so do we ("0,1,-1,2" -> ("0", "1"))."""
    if value is None:
        return None
    out: list[str] = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            break
        if item.lstrip("-").isdigit():
            if int(item) < 0:
                break
            out.append(str(int(item)))
        elif item.upper().startswith(("GPU-", "MIG-")):
            out.append(item)
        else:
            break
    return tuple(out)


def parse_rank_filter(text: str | None, world_size: int) -> frozenset[int] | None:
    """`--ranks 0,2-3` -> {0, 2, 3}; None shows every rank."""
    if text is None:
        return None
    wanted: set[int] = set()
    for item in "".join(text.split()).split(","):
        lo_text, dash, hi_text = item.partition("-")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if dash else lo
        except ValueError:
            raise LaunchError(f"--ranks {text!r}: {item!r} is not a rank or range (write 0 or 0,2-3).") from None
        if lo < 0 or hi < lo:
            raise LaunchError(f"--ranks {text!r}: {item!r} is not a valid range (write e.g. 0-3).")
        wanted.update(range(lo, hi + 1))
    bad = sorted(r for r in wanted if r >= world_size)
    if bad:
        raise LaunchError(
            f"--ranks {text!r} names rank(s) {', '.join(map(str, bad))}, but the job has "
            f"{world_size} ranks (0-{world_size - 1})."
        )
    return frozenset(wanted)


@dataclass(frozen=True)
class DeviceInfo:
    """What the launcher's machine offers: the GPUs it may use (CUDA_VISIBLE_DEVICES entries
    or physical indices) and its CPU cores."""

    gpus: tuple[str, ...]
    cores: int
    # True when the list came from CUDA_VISIBLE_DEVICES (its entries are then used verbatim).
    from_env: bool = False
    driver_present: bool = False


def build_plan(
    options: LaunchOptions,
    hosts: Sequence[Host],
    devices: DeviceInfo,
    *,
    master_port: int,
    run_id: str,
    config_path: str | None = None,
    config_json: str | None = None,
    node_env: Mapping[str, Mapping[str, str]] | None = None,
    cwd: str | None = None,
    local_rank_arg: str | None = None,
) -> LaunchPlan:
    """Pure: options + selected hosts (slots already narrowed by include/exclude/num_nodes)
    + this machine's devices -> the plan. Raises LaunchError for impossible requests."""
    k = options.effective_ranks_per_gpu
    if k < 1:
        raise LaunchError(f"--ranks_per_gpu must be at least 1 (got {k}).")
    device = _resolve_device(options, devices, any_local=any(h.is_local for h in hosts))
    if device == "cpu" and k != 1:
        raise LaunchError(
            f"--ranks_per_gpu {k} needs GPUs, but the job runs on CPU. On CPU, --num_gpus N "
            "already means N CPU ranks; leave out --ranks_per_gpu."
        )
    backend: Literal["nccl", "gloo"] = "nccl" if device == "cuda" and k == 1 else "gloo"

    nodes: list[NodePlan] = []
    rank = 0
    for node_rank, host in enumerate(hosts):
        slots = host.slots
        if options.num_gpus is not None:
            slots = slots[: math.ceil(options.num_gpus / k)]
        n_ranks = len(slots) * k if options.num_gpus is None else min(options.num_gpus, len(slots) * k)
        visible: tuple[str, ...] | None = None
        if device == "cuda":
            visible = _visible_for(host, slots, devices)
        specs = []
        for local in range(n_ranks):
            gpu = local // k if device == "cuda" else None
            specs.append(RankSpec(rank, local, node_rank, host.name, gpu))
            rank += 1
        env = dict((node_env or {}).get(host.name, {}))
        nodes.append(NodePlan(node_rank, host, tuple(specs), visible, env))
    if rank == 0:
        raise LaunchError("the selection leaves no rank to start.")

    omp = {
        n.node_rank: default_omp_threads(devices.cores, len(n.ranks)) for n in nodes if n.is_local
    }
    master_addr = options.master_addr or ("127.0.0.1" if all(n.is_local for n in nodes) else hosts[0].name)
    return LaunchPlan(
        run_id=run_id,
        nodes=tuple(nodes),
        world_size=rank,
        master_addr=master_addr,
        master_port=master_port,
        device=device,
        backend=backend,
        ranks_per_gpu=k,
        pg_timeout=options.pg_timeout or DEFAULT_PG_TIMEOUT_S,
        target=options.target,
        config_path=config_path,
        config_json=config_json,
        cwd=cwd or os.getcwd(),
        omp_threads=omp,
        local_rank_arg=local_rank_arg,
        deepspeed_compat=bool(options.deepspeed_compat),
        resume_from=os.path.abspath(options.resume_from) if options.resume_from else None,
        save_on_preemption=bool(options.save_on_preemption),
        preemption_grace=(
            (options.preemption_grace or DEFAULT_PREEMPTION_GRACE_S) if options.save_on_preemption else None
        ),
    )


def local_slot_count(options: LaunchOptions, devices: DeviceInfo) -> int:
    """How many slots `localhost` offers: its visible GPUs, or (CPU) the ranks asked for."""
    device = _resolve_device(options, devices)
    if device == "cuda":
        if options.num_gpus is not None and options.num_gpus > len(devices.gpus) * options.effective_ranks_per_gpu:
            per = f" x --ranks_per_gpu {options.effective_ranks_per_gpu}" if options.effective_ranks_per_gpu > 1 else ""
            raise LaunchError(
                f"--num_gpus {options.num_gpus} asks for more ranks than this machine has: "
                f"{len(devices.gpus)} visible GPU(s){per} = {len(devices.gpus) * options.effective_ranks_per_gpu}"
                f"{_cvd_note(devices)}. Lower --num_gpus, or use --device cpu for CPU ranks."
            )
        return len(devices.gpus)
    return options.num_gpus if options.num_gpus is not None else DEFAULT_CPU_RANKS


def _cvd_note(devices: DeviceInfo) -> str:
    return " (limited by CUDA_VISIBLE_DEVICES)" if devices.from_env else ""


def _resolve_device(options: LaunchOptions, devices: DeviceInfo, *, any_local: bool = True) -> Literal["cuda", "cpu"]:
    if options.device == "cpu":
        return "cpu"
    if options.device == "cuda":
        # Launching GPU nodes from a machine without GPUs (a login node) is fine: the SSH
        # preflight checks the nodes' GPUs instead.
        if not devices.gpus and any_local:
            raise LaunchError(
                "--device cuda, but no GPU is visible"
                + (" (CUDA_VISIBLE_DEVICES is empty)" if devices.from_env else "")
                + ". Use --device cpu (or leave --device out) to run CPU ranks on gloo."
            )
        return "cuda"
    return "cuda" if devices.gpus and devices.driver_present else "cpu"


def _visible_for(host: Host, slots: Sequence[int], devices: DeviceInfo) -> tuple[str, ...]:
    """CUDA_VISIBLE_DEVICES for a node using `slots`. Locally, slot i is the i-th GPU the
    launcher may use (entry i of its own CUDA_VISIBLE_DEVICES, so `--include localhost:1` with
    CUDA_VISIBLE_DEVICES=GPU-aa,GPU-bb gives GPU-bb); remotely it is the physical index."""
    if host.is_local:
        bad = [s for s in slots if s >= len(devices.gpus)]
        if bad:
            raise LaunchError(
                f"GPU slot(s) {', '.join(map(str, bad))} of {host.name} do not exist: "
                f"{len(devices.gpus)} GPU(s) are visible{_cvd_note(devices)}."
            )
        return tuple(devices.gpus[s] for s in slots)
    return tuple(str(s) for s in slots)
