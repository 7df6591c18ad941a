"""`zerorun [launch options] SCRIPT [ARGS...]` (or `-m MODULE [ARGS...]`): the launch command.

Launcher options end at SCRIPT (or `-m MODULE`); everything after it belongs to the script,
even when it looks like one of ours. Every multi-word option takes both spellings
(`--num_gpus` as DeepSpeed users type it, `--num-gpus` as typer and torchrun users do): the
underscore form is rewritten before parsing, so help shows one. Parsing stops here: the
options become a frozen `LaunchOptions`, and `_run` hands them to `launch.job.run_job` (through
`launch.restart`, which calls it again after a retryable failure with --max_restarts; or
`plan_job` for `--dry-run`) and returns the exit code.
No torch at module level: `zerorun --help` must start fast.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any, Optional

import typer

from zerorun._version import __version__
from zerorun.cli.errors import report_errors
from zerorun.launch.plan import LaunchOptions, Target

__all__ = ["app", "typer_app", "normalize_argv", "main"]

_SUBCOMMANDS_EPILOG_MARK = "Subcommands"


def _epilog() -> str:
    from zerorun.cli.commands import SUBCOMMANDS

    rows = "\n\n".join(f"zerorun {name}: {text}" for name, (_, text) in SUBCOMMANDS.items())
    return (
        f"{_SUBCOMMANDS_EPILOG_MARK} (zerorun NAME --help for details):\n\n{rows}\n\n"
        "Every multi-word option also takes underscores (--num_gpus = --num-gpus). "
        "Example: zerorun --num_gpus 2 train.py --deepspeed ds_config.json"
    )


typer_app = typer.Typer(
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"zerorun {__version__}")
        raise typer.Exit(0)


@typer_app.command(epilog=_epilog(), no_args_is_help=True)
def launch(
    script: Optional[str] = typer.Argument(None, metavar="SCRIPT", help="Python script every rank runs."),  # noqa: UP045
    script_args: Optional[list[str]] = typer.Argument(  # noqa: UP045
        None, metavar="ARGS", help="Arguments of the script, passed on unchanged."
    ),
    module: Optional[str] = typer.Option(None, "-m", metavar="MODULE", help="Run a module, like python -m."),  # noqa: UP045
    module_flag: bool = typer.Option(
        False, "--module", help="SCRIPT is a module name (DeepSpeed's and torchrun's spelling of -m)."
    ),
    num_gpus: Optional[int] = typer.Option(  # noqa: UP045
        None, "--num-gpus", metavar="N", min=1, help="Ranks per node (default: every visible GPU; 2 CPU ranks without GPU)."
    ),
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node", metavar="N", min=1, help="Same as --num-gpus (torchrun)."),  # noqa: UP045
    include: Optional[str] = typer.Option(None, "--include", metavar="SELECTOR", help="Hosts/slots to use: localhost:0,2 or host1:0-3@host2."),  # noqa: UP045
    exclude: Optional[str] = typer.Option(None, "--exclude", metavar="SELECTOR", help="Hosts/slots to leave out (same syntax)."),  # noqa: UP045
    device: Optional[str] = typer.Option(  # noqa: UP045
        None, "--device", metavar="[auto|cuda|cpu]", help="Where ranks run (default auto: cuda when GPUs are visible)."
    ),
    ranks_per_gpu: Optional[int] = typer.Option(  # noqa: UP045
        None, "--ranks-per-gpu", metavar="K", min=1, help="K ranks share one GPU (rank uses GPU LOCAL_RANK // K; gloo)."
    ),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", metavar="HOST", help="Address of rank 0 (default: first host)."),  # noqa: UP045
    master_port: Optional[int] = typer.Option(  # noqa: UP045
        None, "--master-port", metavar="PORT", min=1, max=65535, help="Rendezvous port (default: a free port)."
    ),
    config: Optional[str] = typer.Option(None, "--config", metavar="FILE", help="Config file (YAML or DeepSpeed JSON) to validate and use."),  # noqa: UP045
    log_dir: Optional[str] = typer.Option(None, "--log-dir", metavar="DIR", help="Write rankN.log, events.jsonl and summary.json here."),  # noqa: UP045
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the rank table and environment; start nothing."),
    ranks: Optional[str] = typer.Option(None, "--ranks", metavar="RANKS", help="Show only these ranks on the console (0 or 0,2-3)."),  # noqa: UP045
    pg_timeout: Optional[float] = typer.Option(  # noqa: UP045
        None, "--pg-timeout", metavar="SECONDS", min=1, help="Process-group timeout in seconds for zerorun.initialize (default 600)."
    ),
    grace_period: float = typer.Option(
        5.0, "--grace-period", metavar="SECONDS", min=0, help="Seconds ranks get after SIGTERM before SIGKILL."
    ),
    hang_timeout: Optional[float] = typer.Option(  # noqa: UP045
        None, "--hang-timeout", metavar="SECONDS", min=1, help="Seconds of silence from every rank before stacks are dumped and the job stopped."
    ),
    hostfile: Optional[str] = typer.Option(None, "--hostfile", metavar="FILE", help="DeepSpeed hostfile: run on several nodes over SSH."),  # noqa: UP045
    num_nodes: Optional[int] = typer.Option(None, "--num-nodes", metavar="N", min=1, help="Use the first N hosts of the hostfile."),  # noqa: UP045
    ssh_accept_new_hosts: bool = typer.Option(
        False, "--ssh-accept-new-hosts", help="Trust unknown SSH host keys on first use."
    ),
    ssh_parallelism: Optional[int] = typer.Option(  # noqa: UP045
        None, "--ssh-parallelism", metavar="N", min=1, help="SSH connections opened at once (default 32, like pdsh)."
    ),
    ssh_connect_timeout: Optional[float] = typer.Option(  # noqa: UP045
        None, "--ssh-connect-timeout", metavar="SECONDS", min=0.1,
        help="Per-node SSH connect timeout (default: ConnectTimeout from ~/.ssh/config, else 10).",
    ),
    ssh_port: Optional[int] = typer.Option(  # noqa: UP045
        None, "--ssh-port", metavar="PORT", min=1, max=65535,
        help="SSH port of every node (default: Port from ~/.ssh/config, else 22; DeepSpeed's --ssh_port).",
    ),
    remote_python: Optional[str] = typer.Option(None, "--remote-python", metavar="PATH", help="Python on the nodes (default: this one's path)."),  # noqa: UP045
    remote_cwd: Optional[str] = typer.Option(None, "--remote-cwd", metavar="DIR", help="Working directory on the nodes (default: this cwd)."),  # noqa: UP045
    env: Optional[list[str]] = typer.Option(  # noqa: UP045
        None, "--env", metavar="KEY=VAL", help="Set a variable for every rank (repeatable; KEY alone copies it)."
    ),
    no_local_rank: bool = typer.Option(
        False, "--no-local-rank", help="Never pass --local_rank=N (passed only to scripts that declare it)."
    ),
    deepspeed_compat: bool = typer.Option(
        False,
        "--deepspeed-compat",
        help="`import deepspeed` in the ranks is zerorun's DeepSpeed layer (DeepSpeed scripts, HF Trainer "
        "--deepspeed); every script gets --local_rank=N.",
    ),
    launcher: Optional[str] = typer.Option(  # noqa: UP045
        None,
        "--launcher",
        metavar="[auto|local|ssh|slurm|mpi|pernode|sim]",
        help="How nodes are started (default auto: a Slurm step or --nnodes -> pernode, a Slurm allocation -> slurm, "
        "a hostfile -> ssh, else local; see docs/clusters.md; sim: the hostfile's nodes simulated here, docs/multinode.md).",
    ),
    nnodes: Optional[int] = typer.Option(  # noqa: UP045
        None, "--nnodes", metavar="N", min=1, help="Per-node mode: nodes in the job (one zerorun per node; torchrun's --nnodes)."
    ),
    node_rank: Optional[int] = typer.Option(  # noqa: UP045
        None, "--node-rank", metavar="R", min=0, help="Per-node mode: this node's rank (0 is the master)."
    ),
    rdzv_port: Optional[int] = typer.Option(  # noqa: UP045
        None, "--rdzv-port", metavar="PORT", min=1, max=65535, help="Per-node mode: zerorun's rendezvous port on node 0 (default: master port + 1)."
    ),
    rdzv_timeout: Optional[float] = typer.Option(  # noqa: UP045
        None, "--rdzv-timeout", metavar="SECONDS", min=1, help="Per-node mode: how long nodes wait for each other (default 300)."
    ),
    slurm_args: Optional[str] = typer.Option(  # noqa: UP045
        None, "--slurm-args", metavar="ARGS", help="Extra srun options for --launcher slurm, e.g. '--partition gpu --time 1:00:00'."
    ),
    gpus_per_node: Optional[int] = typer.Option(  # noqa: UP045
        None, "--gpus-per-node", metavar="N", min=1,
        help="--launcher slurm from a login node: GPUs per node of the allocation salloc obtains (with --num_nodes).",
    ),
    mpi_args: Optional[str] = typer.Option(  # noqa: UP045
        None, "--mpi-args", metavar="ARGS", help="Extra mpirun options for --launcher mpi, e.g. '--mca btl_tcp_if_include eth0'."
    ),
    max_restarts: Optional[int] = typer.Option(  # noqa: UP045
        None, "--max-restarts", metavar="N", min=0,
        help="Restart the job up to N times after a rank is killed, a node is lost or a hang (docs/fault-tolerance.md).",
    ),
    restart_on_any_failure: bool = typer.Option(
        False, "--restart-on-any-failure", help="Also restart after an exception every rank raised before the first step."
    ),
    resume_from: Optional[str] = typer.Option(  # noqa: UP045
        None, "--resume-from", metavar="DIR", help="zerorun.initialize loads the latest checkpoint of DIR (if any) in every rank."
    ),
    save_on_preemption: bool = typer.Option(
        False, "--save-on-preemption", help="On SIGTERM the ranks save a checkpoint at the next step and exit with code 75."
    ),
    preemption_grace: Optional[float] = typer.Option(  # noqa: UP045
        None, "--preemption-grace", metavar="SECONDS", min=1, help="Seconds ranks get to save after SIGTERM (default 25)."
    ),
    exclude_failed_nodes: bool = typer.Option(
        False, "--exclude-failed-nodes", help="With --max_restarts and a hostfile: leave a lost or signal-killed node out of the next attempt."
    ),
    min_nodes: Optional[int] = typer.Option(  # noqa: UP045
        None, "--min-nodes", metavar="N", min=1, help="With --exclude_failed_nodes: stop restarting below N nodes (default 1)."
    ),
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_version, help="Show the version."),
) -> None:
    """Start a job: every rank runs SCRIPT (or -m MODULE) with torchrun's environment."""
    del version
    if module is None and script is None:
        raise typer.BadParameter("give a SCRIPT to run, or -m MODULE", param_hint="SCRIPT")
    if num_gpus is not None and nproc_per_node is not None and num_gpus != nproc_per_node:
        raise typer.BadParameter(
            f"--num_gpus {num_gpus} and --nproc_per_node {nproc_per_node} disagree; give one.",
            param_hint="--num_gpus",
        )
    if device is not None and device not in ("auto", "cuda", "cpu"):
        raise typer.BadParameter(f"{device!r} is not one of auto, cuda, cpu.", param_hint="--device")
    args = list(script_args or [])
    if module_flag and module is None and script is not None:
        module, script = script, None
    if module is not None:
        target = Target(module=module, args=tuple(([script] if script is not None else []) + args))
    else:
        target = Target(script=script, args=tuple(args))
    options = LaunchOptions(
        target=target,
        num_gpus=num_gpus if num_gpus is not None else nproc_per_node,
        include=include,
        exclude=exclude,
        device=None if device in (None, "auto") else device,  # type: ignore[arg-type]
        ranks_per_gpu=ranks_per_gpu,
        master_addr=master_addr,
        master_port=master_port,
        config=config,
        log_dir=log_dir,
        dry_run=dry_run,
        ranks=ranks,
        pg_timeout=pg_timeout,
        grace_period=grace_period,
        hang_timeout=hang_timeout,
        hostfile=hostfile,
        num_nodes=num_nodes,
        ssh_accept_new_hosts=ssh_accept_new_hosts,
        ssh_parallelism=ssh_parallelism,
        ssh_connect_timeout=ssh_connect_timeout,
        ssh_port=ssh_port,
        remote_python=remote_python,
        remote_cwd=remote_cwd,
        env=tuple(env or ()),
        pass_local_rank=not no_local_rank,
        deepspeed_compat=True if deepspeed_compat else None,
        launcher=launcher,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_port=rdzv_port,
        rdzv_timeout=rdzv_timeout,
        slurm_args=slurm_args,
        max_restarts=max_restarts,
        restart_on_any_failure=True if restart_on_any_failure else None,
        resume_from=resume_from,
        save_on_preemption=True if save_on_preemption else None,
        preemption_grace=preemption_grace,
        exclude_failed_nodes=True if exclude_failed_nodes else None,
        min_nodes=min_nodes,
        mpi_args=mpi_args,
        gpus_per_node=gpus_per_node,
    )
    code = _run(options)
    raise typer.Exit(code)


# --- argv normalisation -------------------------------------------------------------------


def _option_table() -> tuple[set[str], set[str]]:
    """(options taking a value, flags) of the launch command, from typer itself."""
    command = typer.main.get_command(typer_app)
    takes_value: set[str] = set()
    flags: set[str] = set()
    for param in command.params:
        opts = [*getattr(param, "opts", []), *getattr(param, "secondary_opts", [])]
        if not any(o.startswith("-") for o in opts):
            continue
        target = flags if getattr(param, "is_flag", False) else takes_value
        target.update(opts)
    return takes_value, flags


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """Rewrite `--num_gpus` to `--num-gpus` (launcher options only) and put `--` before
    SCRIPT, or after `-m MODULE`, so nothing of the script's is parsed as ours."""
    takes_value, flags = _option_table()
    out: list[str] = []
    i = 0
    args = list(argv)
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return out + args[i:]
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            hyphenated = name.replace("_", "-")
            if hyphenated in takes_value or hyphenated in flags:
                name = hyphenated
            out.append(name + eq + value)
            if name in takes_value and not eq and i + 1 < len(args):
                out.append(args[i + 1])
                i += 1
            i += 1
            continue
        if arg == "-m":
            if i + 1 >= len(args):
                return out + [arg]
            return out + ["-m", args[i + 1], "--", *args[i + 2 :]]
        if arg.startswith("-m") and len(arg) > 2:  # -mpackage.module, as python accepts
            return out + ["-m", arg[2:], "--", *args[i + 1 :]]
        if arg.startswith("-") and arg != "-":
            out.append(arg)
            i += 1
            continue
        return out + ["--", *args[i:]]
    return out


class _App:
    """What `zerorun.cli.main` calls: normalise argv, then run the typer command."""

    def __call__(self, args: Sequence[str] | None = None, prog_name: str = "zerorun") -> Any:
        global _invoked_argv
        argv = list(sys.argv[1:] if args is None else args)
        _invoked_argv = argv
        return typer_app(args=normalize_argv(argv), prog_name=prog_name)


# The launch command line as given (what `--launcher slurm` re-runs inside salloc): the
# arguments this command was called with, which are sys.argv's only when run as `zerorun ...`.
_invoked_argv: list[str] | None = None


app = _App()


def main() -> None:
    app()


# --- the launch itself --------------------------------------------------------------------


@report_errors
def _run(options: LaunchOptions) -> int:
    """The job's exit code: 0 after a dry run, otherwise the supervisor's (Contract 5)."""
    from zerorun.launch.job import plan_job, with_config_launcher
    from zerorun.launch.slurm_env import slurm_job_id

    try:
        if slurm_job_id(os.environ) is None:
            # `--launcher slurm` (or the config's `launcher: slurm`; the command line wins) on a
            # login node: obtain the allocation first.
            merged = options if options.launcher is not None else with_config_launcher(options)
            if merged.launcher == "slurm":
                return _in_new_allocation(merged)
        if options.dry_run:
            from zerorun.launch.dry_run import format_dry_run

            job = plan_job(options)
            if job.launcher is not None:
                sys.stderr.write(f"zerorun: {job.launcher.line()}\n")
            sys.stdout.write(format_dry_run(job.plan))
            return 0
        from zerorun.launch.restart import run_with_restarts

        return run_with_restarts(options)  # one run_job call unless --max_restarts
    except KeyboardInterrupt:
        # Ctrl-C before the supervisor took over signals: nothing was started yet.
        sys.stderr.write("zerorun: interrupted before the job started\n")
        return 130


def _in_new_allocation(options: LaunchOptions) -> int:
    """`--launcher slurm` on a login node: salloc obtains the allocation and runs this same
    command inside it (where the slurm launcher starts the nodes). exec: salloc owns the
    terminal's signals from here on, as when the user types it."""
    import shlex

    from zerorun.launch.environment import scrub
    from zerorun.launch.slurm import salloc_command

    given = _invoked_argv if _invoked_argv is not None else sys.argv[1:]
    argv = salloc_command(
        num_nodes=options.num_nodes,
        gpus_per_node=options.gpus_per_node,
        slurm_args=options.slurm_args,
        inner=[sys.executable, "-m", "zerorun", *given],
    )
    # The script's arguments may carry a secret that is also in the environment (as in --dry-run).
    sys.stderr.write(
        f"zerorun: launcher slurm: outside an allocation, obtaining one: {scrub(shlex.join(argv), os.environ)}\n"
    )
    if options.dry_run:
        return 0
    sys.stderr.flush()
    sys.stdout.flush()
    try:
        os.execvp(argv[0], argv)
    except OSError as err:
        from zerorun.errors import LaunchError

        raise LaunchError(f"cannot run salloc ({err.strerror or err}): --launcher slurm outside an allocation needs Slurm's client tools.") from None
    return 0  # not reached
