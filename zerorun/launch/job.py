"""The launch pipeline: options -> plan -> prepared nodes -> a supervised job -> `JobResult`.

What torchrun's `run.py` does with `config_from_args` + `elastic_launch`: `cli/launch_cmd.py`
parses the command line into a frozen `LaunchOptions`, calls `run_job` and maps the result to an
exit code; everything between lives here, in three steps:

1. `plan_job(options)`: the config is loaded and validated, its `launcher:` section merged under
   the command line, the script checked, hosts selected, the environment of each node built,
   the master port chosen, and the `LaunchPlan` built. Nothing starts; this is `--dry-run`.
2. `_prepare_nodes(job)`: one `NodeRunner` per node. A plan with remote nodes goes through the
   SSH preflight (`launch/remote.py`), which returns the plan with the master address the ranks
   will use; otherwise one `LocalRunner` per node. A new transport (Slurm, MPI, the scale
   simulation) is chosen here and is one module implementing `NodeRunner`.
3. `Supervisor(plan, runners, console).run()`: start, watch, fail fast, the `JobResult`.

No torch, no typer here; errors are `ZerorunError`s with the fix in the message, which only
the CLI turns into exit codes.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerorun.errors import ConfigError, LaunchError
from zerorun.launch import local
from zerorun.launch import plan as plan_mod
from zerorun.launch.environment import build_env_spec
from zerorun.launch.hosts import local_hosts, parse_hostfile, select_hosts
from zerorun.launch.messages import NodeRunner
from zerorun.launch.pernode import PerNodeSpec
from zerorun.launch.plan import LaunchOptions, LaunchPlan
from zerorun.launch.result import JobResult
from zerorun.launch.selection import LauncherChoice, choose_launcher
from zerorun.launch.supervisor import Console, Supervisor
from zerorun.launch.target import check_target, find_config_argument, local_rank_arg

if TYPE_CHECKING:
    from zerorun.config.batch import Rebatch
    from zerorun.config.loader import LoadedConfig

__all__ = ["PlannedJob", "plan_job", "run_job", "with_config_launcher"]


@dataclass(frozen=True)
class PlannedJob:
    """A job checked and planned, nothing started (what `--dry-run` prints)."""

    options: LaunchOptions  # the command line with the config's `launcher:` section merged under it
    plan: LaunchPlan  # the master address is the launcher's view until the preflight replaces it
    rank_filter: frozenset[int] | None  # `--ranks`: the ranks the console shows (None: all)
    withheld: tuple[str, ...]  # secret-looking variables not sent to remote nodes (a note each)
    launcher: LauncherChoice | None = None  # which transport and why (launch/selection.py)
    pernode: PerNodeSpec | None = None  # per-node mode's node count, rank, master, rendezvous
    batch_note: str | None = None  # a restart at another world size: what changed in the batch triad

    @property
    def multinode(self) -> bool:
        return self.options.hostfile is not None or self.launcher_name == "slurm"

    @property
    def launcher_name(self) -> str:
        return self.launcher.launcher if self.launcher is not None else ("ssh" if self.options.hostfile else "local")


def run_job(options: LaunchOptions, console: Console | None = None) -> JobResult:
    """Plan, prepare the nodes and supervise one run of the job; its `JobResult`.

    `console` renders the run (None: the default one, rich on a terminal, showing the ranks
    of `options.ranks`). Raises `ZerorunError` (config, hostfile, launch problems) before
    anything started; once ranks run, every outcome is a `JobResult` (its `exit_code` is the
    launcher's). `options.dry_run` is the caller's business: `plan_job` is the dry run.
    Every call plans afresh (a free master port, the preflight), so a restart is another call.
    """
    if options.dry_run:
        raise ValueError("run_job starts the job; for a dry run call plan_job")
    job = plan_job(options)
    if job.launcher is not None:
        _note(job.launcher.line())
    if job.options.log_dir is not None:
        try:
            Path(job.options.log_dir).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise LaunchError(
                f"--log_dir {job.options.log_dir}: cannot create the directory ({err.strerror or err})."
            ) from None
    plan, runners = _prepare_nodes(job)
    if console is None:
        from zerorun.launch.console import make_console

        console = make_console(ranks=job.rank_filter)
    for name in job.withheld:
        console.note(f"{name} looks secret and was not sent to remote nodes; name it with --env {name} to send it.", level="warn")
    supervisor = Supervisor(
        plan,
        runners,
        console,
        grace_period=job.options.grace_period,
        hang_timeout=job.options.hang_timeout,
        log_dir=job.options.log_dir,
        preemption_grace=plan.preemption_grace,
    )
    return replace(supervisor.run(), batch_note=job.batch_note)


def plan_job(options: LaunchOptions) -> PlannedJob:
    """Validate everything and build the plan; start nothing. Config warnings and notes go to
    stderr (before any console exists)."""
    loaded, config_path, config_json, section, config_dir = _load_config(options)
    options = options.merged(section, base_dir=config_dir)
    _check_checkpoint_flags(options, loaded, config_path)
    launcher = choose_launcher(
        options.launcher, hostfile=options.hostfile, nnodes=options.nnodes, node_rank=options.node_rank, environ=os.environ
    )
    multinode = options.hostfile is not None or launcher.launcher == "slurm"
    if not multinode or options.remote_cwd is None:
        # With --remote_cwd the script is a path on the nodes: their preflight checks it there.
        check_target(options.target)

    devices = local.detect_devices()
    spec: PerNodeSpec | None = None
    if launcher.launcher == "pernode":
        from zerorun.launch import pernode

        spec = pernode.resolve(
            nnodes=options.nnodes,
            node_rank=options.node_rank,
            master_addr=options.master_addr,
            master_port=options.master_port,
            rdzv_port=options.rdzv_port,
            nproc=options.num_gpus,
            rdzv_timeout=options.rdzv_timeout,
            environ=os.environ,
            slurm=launcher.slurm,
        )
        options = replace(options, num_gpus=spec.nproc, master_addr=spec.master_addr, master_port=spec.master_port)
        hosts = pernode.provisional_hosts(spec, plan_mod.local_slot_count(options, devices))
    elif launcher.launcher == "slurm":
        from zerorun.launch.slurm import allocation_hosts

        hosts = select_hosts(
            allocation_hosts(launcher.slurm, num_gpus=options.num_gpus, k=options.effective_ranks_per_gpu),
            include=options.include,
            exclude=options.exclude,
            num_nodes=options.num_nodes,
            source=f"Slurm allocation {launcher.slurm.job_id}",
        )
    elif options.hostfile is not None:
        hosts = select_hosts(
            parse_hostfile(options.hostfile),
            include=options.include,
            exclude=options.exclude,
            num_nodes=options.num_nodes,
            num_gpus=None if options.num_gpus is None else -(-options.num_gpus // options.effective_ranks_per_gpu),
            source=f"hostfile {options.hostfile}",
        )
    else:
        if options.num_nodes not in (None, 1):
            raise LaunchError(f"--num_nodes {options.num_nodes} needs --hostfile (without one, zerorun runs on this machine).")
        slots = plan_mod.local_slot_count(options, devices)
        hosts = select_hosts(
            local_hosts(slots), include=options.include, exclude=options.exclude, source="this machine (localhost)"
        )

    env_spec = build_env_spec(
        cli_env=options.env,
        config_env=section.get("env") or {},
        config_host_env=section.get("host_env") or {},
        hostfile_env={h.name: h.env for h in hosts if h.env},
    )
    node_env = {h.name: env_spec.for_host(h.name, remote=not h.is_local) for h in hosts}

    if options.master_port is not None:
        port = options.master_port
        if not multinode and spec is None and not options.dry_run and not local.port_is_free(port):
            raise LaunchError(
                f"--master_port {port} is already in use on this machine (another job or a "
                "leftover rank?). Pick another port, or leave --master_port out to get a free one."
            )
    else:
        port = local.choose_free_port()

    plan = plan_mod.build_plan(
        options,
        hosts,
        devices,
        master_port=port,
        run_id=options.run_id or plan_mod.new_run_id(),
        config_path=config_path,
        config_json=config_json,
        node_env=node_env,
        local_rank_arg=local_rank_arg(options),
    )
    if multinode and options.device is None and options.num_gpus is None and any(not n.is_local for n in plan.nodes):
        plan = replace(plan, device_per_node=True)  # each node's preflight decides (launch/node_devices.py)
    rank_filter = plan_mod.parse_rank_filter(options.ranks, plan.world_size)
    batch_note = None
    if loaded is not None:
        # The batch triad against the real world size: a mismatch stops the job here, with
        # the arithmetic, instead of in every rank. A restart at another world size (nodes
        # left out) re-resolves it instead and says what changed (docs/fault-tolerance.md).
        change = None
        if options.batch_world_size is not None:
            change = _rebatch(loaded, options.batch_world_size, plan.world_size)
        if change is not None:
            _note(change.message)
            plan, batch_note = replace(plan, batch=change.to_env()), change.message
        else:
            loaded.resolve_batch(plan.world_size)
    if plan.device == "cuda" and not multinode and not devices.driver_present and not options.dry_run:
        raise LaunchError(
            f"--device cuda: CUDA_VISIBLE_DEVICES lists {len(devices.gpus)} GPU(s), but this machine has "
            "no NVIDIA driver (no /proc/driver/nvidia, no nvidia-smi). Use --device cpu to run CPU ranks."
        )

    local_ranks = sum(len(n.ranks) for n in plan.nodes if n.is_local)
    if plan.device == "cpu" and local_ranks > devices.cores:
        _note(
            f"warning: {local_ranks} CPU ranks on {devices.cores} core(s) of this machine: they will "
            "take turns on the cores (fine for testing, slow for training)."
        )
    withheld = tuple(env_spec.withheld) if multinode else ()
    return PlannedJob(
        options=options,
        plan=plan,
        rank_filter=rank_filter,
        withheld=withheld,
        launcher=launcher,
        pernode=spec,
        batch_note=batch_note,
    )


def _rebatch(loaded: LoadedConfig, from_world: int, to_world: int) -> Rebatch | None:
    from zerorun.config.batch import rebatch

    c = loaded.config
    return rebatch(
        c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps,
        from_world=from_world, to_world=to_world,
    )  # fmt: skip


def _prepare_nodes(job: PlannedJob) -> tuple[LaunchPlan, list[NodeRunner]]:
    """The node runners of the plan, and the plan they run (the preflight of remote nodes may
    change its master address and port). Nothing has started when this returns."""
    if job.pernode is not None:
        from zerorun.launch import pernode

        return pernode.prepare(job.plan, job.options, job.pernode, local.detect_devices())
    if job.launcher_name == "slurm":
        from zerorun.launch import slurm

        assert job.launcher is not None
        return slurm.prepare(job.plan, job.options, job.launcher.slurm, withheld=job.withheld)
    if job.launcher_name == "mpi":
        from zerorun.launch import mpi

        return mpi.prepare(job.plan, job.options, withheld=job.withheld)
    if job.launcher_name == "sim":
        from zerorun.launch import simulate

        return simulate.prepare_job(job.plan, job.options)
    if job.multinode:
        from zerorun.launch import remote

        return remote.prepare(job.plan, job.options)
    return job.plan, [local.LocalRunner(job.plan, node) for node in job.plan.nodes]


def with_config_launcher(options: LaunchOptions) -> LaunchOptions:
    """The options with the config's `launcher:` section merged under the command line, as
    `plan_job` will run them; for decisions taken before planning (`--launcher slurm` from a
    login node obtains its allocation first). The config's notes are left to `plan_job`."""
    section, config_dir = _load_config(options, quiet=True)[3:]
    return options.merged(section, base_dir=config_dir)


def _load_config(
    options: LaunchOptions, *, quiet: bool = False
) -> tuple[LoadedConfig | None, str | None, str | None, dict[str, Any], Path | None]:
    """Validate the config before anything starts: (the loaded config, its path as given, its
    JSON for the ranks, the `launcher:` section as the user gave it, the config's directory).
    Warnings and notes go to stderr unless `quiet`."""
    path = options.config
    in_script = find_config_argument(options.target.args)
    if path is None and in_script is not None:
        path = in_script[1]
    if path is None:
        return None, None, None, {}, None
    if not Path(path).exists():
        where = f"the script's {in_script[0]} argument" if options.config is None and in_script else "--config"
        raise ConfigError(f"config file {path} (from {where}) does not exist.")
    from zerorun.config import load_config

    loaded = load_config(path, resume_from=options.resume_from)
    for w in [] if quiet else loaded.warnings:
        _note(f"config {path}: warning: {w}")
    for n in [] if quiet else loaded.notices:
        _note(f"config {path}: {n}")
    section = loaded.config.launcher.model_dump(exclude_unset=True)
    return loaded, str(path), loaded.to_json(), section, Path(path).resolve().parent


def _check_checkpoint_flags(options: LaunchOptions, loaded: LoadedConfig | None, config_path: str | None) -> None:
    """--save_on_preemption needs a checkpoint directory: the config's, or --resume_from's
    (the config's own keys were checked by load_config). Without a config the launcher knows,
    the script's own config decides: the runtime checks it (runtime/checkpoint/options.py)."""
    from zerorun.config.rules import checkpoint_dir_problems

    if loaded is None:
        return
    problems = checkpoint_dir_problems(
        dir=loaded.config.zerorun.checkpoint.dir,
        resume_from=options.resume_from,
        auto_resume=False,
        every_n_steps=0,
        save_on_preemption=bool(options.save_on_preemption),
    )
    if problems:
        raise ConfigError(f"{config_path}: {problems[0]}")


def _note(text: str) -> None:
    sys.stderr.write(f"zerorun: {text}\n")
