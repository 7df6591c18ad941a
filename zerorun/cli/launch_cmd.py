"""`zerorun [launch options] SCRIPT [ARGS...]` (or `-m MODULE [ARGS...]`): the launch command.

Launcher options end at SCRIPT (or `-m MODULE`); everything after it belongs to the script,
even when it looks like one of ours. Every multi-word option takes both spellings
(`--num_gpus` as DeepSpeed users type it, `--num-gpus` as typer and torchrun users do): the
underscore form is rewritten before parsing, so help shows one. Parsing stops here: the
options become a frozen `LaunchOptions`, and `_run` hands them to the library.
No torch at module level: `zerorun --help` must start fast.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import typer

from zerorun import __version__
from zerorun.cli.errors import report_errors
from zerorun.errors import ConfigError, LaunchError
from zerorun.launch.plan import LaunchOptions, Target
from zerorun.launch.target import check_target

__all__ = ["app", "typer_app", "normalize_argv", "main"]

_SUBCOMMANDS_EPILOG_MARK = "Subcommands"


def _epilog() -> str:
    from zerorun.cli import SUBCOMMANDS

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
        remote_python=remote_python,
        remote_cwd=remote_cwd,
        env=tuple(env or ()),
        pass_local_rank=not no_local_rank,
        deepspeed_compat=True if deepspeed_compat else None,
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
        argv = list(sys.argv[1:] if args is None else args)
        return typer_app(args=normalize_argv(argv), prog_name=prog_name)


app = _App()


def main() -> None:
    app()


# --- the launch itself --------------------------------------------------------------------


@report_errors
def _run(options: LaunchOptions) -> int:
    try:
        return _launch(options)
    except KeyboardInterrupt:
        # Ctrl-C before the supervisor took over signals: nothing was started yet.
        sys.stderr.write("zerorun: interrupted before the job started\n")
        return 130


def _launch(options: LaunchOptions) -> int:
    from zerorun.launch import console as console_mod
    from zerorun.launch import local
    from zerorun.launch import plan as plan_mod
    from zerorun.launch.environment import build_env_spec, redact_env
    from zerorun.launch.hosts import local_hosts, parse_hostfile, select_hosts
    from zerorun.launch.supervisor import Supervisor

    loaded, config_path, config_json, section, config_dir = _load_config(options)
    options = options.merged(section, base_dir=config_dir)
    if options.hostfile is None or options.remote_cwd is None:
        # With --remote_cwd the script is a path on the nodes: their preflight checks it there.
        check_target(options.target)

    multinode = options.hostfile is not None
    devices = local.detect_devices()
    if multinode:
        pool = parse_hostfile(options.hostfile)  # type: ignore[arg-type]
        hosts = select_hosts(
            pool,
            include=options.include,
            exclude=options.exclude,
            num_nodes=options.num_nodes,
            num_gpus=None if options.num_gpus is None else -(-options.num_gpus // options.k),
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
        if not multinode and not options.dry_run and not local.port_is_free(port):
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
        local_rank_arg=_local_rank_arg(options),
    )
    rank_filter = plan_mod.parse_rank_filter(options.ranks, plan.world_size)
    if loaded is not None:
        # The batch triad against the real world size: a mismatch stops the job here, with
        # the arithmetic, instead of in every rank.
        loaded.resolve_batch(plan.world_size)
    if plan.device == "cuda" and not multinode and not devices.driver_present and not options.dry_run:
        raise LaunchError(
            f"--device cuda: CUDA_VISIBLE_DEVICES lists {len(devices.gpus)} GPU(s), but this machine has "
            "no NVIDIA driver (no /proc/driver/nvidia, no nvidia-smi). Use --device cpu to run CPU ranks."
        )

    local_ranks = sum(len(n.ranks) for n in plan.nodes if n.is_local)
    if plan.device == "cpu" and local_ranks > devices.cores:
        _stderr_note(
            f"warning: {local_ranks} CPU ranks on {devices.cores} core(s) of this machine: they will "
            "take turns on the cores (fine for testing, slow for training)."
        )

    if options.dry_run:
        _print_dry_run(plan, redact_env)
        return 0
    if options.log_dir is not None:
        try:
            Path(options.log_dir).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise LaunchError(f"--log_dir {options.log_dir}: cannot create the directory ({err.strerror or err}).") from None

    if multinode:
        try:
            from zerorun.launch import ssh
        except ImportError as err:
            raise LaunchError(f"multi-node launching is not available in this build ({err}).") from err
        # The preflight runs here; the plan it returns has the master address the nodes reach.
        plan, runners = ssh.prepare(plan, options)
    else:
        runners = [local.LocalRunner(plan, node) for node in plan.nodes]
    console = console_mod.make_console(ranks=rank_filter)
    for name in env_spec.withheld if multinode else ():
        console.note(f"{name} looks secret and was not sent to remote nodes; name it with --env {name} to send it.", level="warn")
    supervisor = Supervisor(
        plan,
        runners,
        console,
        grace_period=options.grace_period,
        hang_timeout=options.hang_timeout,
        log_dir=options.log_dir,
    )
    return supervisor.run().exit_code


def _local_rank_arg(options: LaunchOptions) -> str | None:
    if not options.pass_local_rank:
        return None
    # DeepSpeed's launcher passes --local_rank=N to every script; with --deepspeed-compat so do
    # we (HF scripts take it through TrainingArguments, not an add_argument we could see).
    fallback = "--local_rank" if options.deepspeed_compat else None
    if options.target.script is None:
        return fallback
    from zerorun.launch.plan import declared_local_rank_arg

    path = Path(options.target.script)
    if path.is_dir():
        path = path / "__main__.py"
    try:
        return declared_local_rank_arg(path.read_text(encoding="utf-8", errors="replace")) or fallback
    except OSError:
        return fallback


def _load_config(options: LaunchOptions) -> tuple[Any, str | None, str | None, dict[str, Any], Path | None]:
    """Validate the config before anything starts. (path, JSON for the ranks, the launcher
    section as given, the config's directory)."""
    from zerorun.launch.plan import find_config_argument

    path = options.config
    in_script = find_config_argument(options.target.args)
    if path is None and in_script is not None:
        path = in_script[1]
    if path is None:
        return None, None, None, {}, None
    if not Path(path).exists():
        where = f"the script's {in_script[0]} argument" if options.config is None and in_script else "--config"
        raise ConfigError(f"config file {path} (from {where}) does not exist.")
    try:
        from zerorun.config import load_config
    except ImportError as err:  # the config package is still being built
        raise ConfigError(f"cannot load configs in this build ({err}).") from err
    loaded = load_config(path)
    for w in loaded.warnings:
        _stderr_note(f"config {path}: warning: {w}")
    for n in loaded.notices:
        _stderr_note(f"config {path}: {n}")
    config = loaded.config
    section_model = getattr(config, "launcher", None)
    section: dict[str, Any] = {}
    if section_model is not None and hasattr(section_model, "model_dump"):
        section = section_model.model_dump(exclude_unset=True)
    to_json = getattr(loaded, "to_json", None)
    if callable(to_json):
        config_json = to_json()
    else:
        config_json = config.model_dump_json(exclude_unset=True)
    return loaded, str(path), config_json, section, Path(path).resolve().parent


def _stderr_note(text: str) -> None:
    sys.stderr.write(f"zerorun: {text}\n")


def _print_dry_run(plan: Any, redact: Any) -> None:
    """The rank table and the environment the ranks get; nothing is started."""
    out = sys.stdout.write
    out(f"zerorun dry run {plan.run_id}: {plan.world_size} rank(s), {len(plan.nodes)} node(s), "
        f"device {plan.device}, backend {plan.backend}, master {plan.master_addr}:{plan.master_port}\n")
    from zerorun.launch.environment import scrub

    # Script arguments may carry a secret that is also in the environment (--hf_token $HF_TOKEN).
    out(f"command: {scrub(shlex.join(plan.rank_argv(plan.ranks[0], 'python')), os.environ)}\n")
    head = ["rank", "local", "node", "host", "device", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"]
    rows = []
    for spec in plan.ranks:
        node = plan.nodes[spec.node_rank]
        env = plan.rank_env(spec)
        base = {**os.environ, **node.env} if node.is_local else dict(node.env)
        omp = plan.defaults_env(spec.node_rank, base).get("OMP_NUM_THREADS", base.get("OMP_NUM_THREADS", "-"))
        dev = f"cuda:{spec.gpu}" if spec.gpu is not None else "cpu"
        rows.append([str(spec.rank), str(spec.local_rank), str(spec.node_rank), spec.host, dev,
                     env.get("CUDA_VISIBLE_DEVICES", "-"), omp])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    for row in [head, *rows]:
        out("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n")
    first = plan.ranks[0]
    env = {k: v for k, v in plan.rank_env(first).items() if k != "ZERORUN_CONFIG_JSON"}
    if plan.config_json is not None:
        env["ZERORUN_CONFIG_JSON"] = f"<{len(plan.config_json)} bytes of JSON>"
    out(f"environment of rank {first.rank} (others differ in RANK, LOCAL_RANK, NODE_RANK, GROUP_RANK, ROLE_RANK):\n")
    for k, v in sorted(redact(env).items()):
        out(f"  {k}={v}\n")
    for node in plan.nodes:
        if node.env:
            out(f"extra environment on {node.host.name}:\n")
            for k, v in sorted(redact(dict(node.env)).items()):
                out(f"  {k}={v}\n")
