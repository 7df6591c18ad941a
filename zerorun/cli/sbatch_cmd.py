"""`zerorun sbatch [SBATCH OPTIONS] [LAUNCH OPTIONS] SCRIPT [ARGS...]`: write a Slurm batch
script that runs the same zerorun command inside the allocation, and submit it.

The options below are this command's (the allocation); everything from the first other
argument on is the zerorun command line, verbatim. Inside the allocation zerorun picks the
slurm launcher by itself (docs/clusters.md). `--dry-run` prints the script and submits nothing.
No torch; typer does not parse this command (the launch arguments pass through untouched; the
launch command's option table only tells where its script starts).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from zerorun.cli.errors import report_errors
from zerorun.errors import LaunchError

__all__ = ["app", "SbatchOptions", "parse_args", "batch_script"]

USAGE = """usage: zerorun sbatch [OPTIONS] [LAUNCH OPTIONS] SCRIPT [ARGS...]

Write a Slurm batch script that runs `zerorun [LAUNCH OPTIONS] SCRIPT [ARGS...]` in the
allocation, and submit it with sbatch. Inside the allocation zerorun starts every node through
srun (the slurm launcher).

options (before the zerorun command line):
  -N, --nodes N            nodes to allocate (required)
  --gpus_per_node N        GPUs per node (#SBATCH --gpus-per-node; also the tasks per node)
  --ntasks_per_node N      tasks per node (zerorun's ranks per node on CPU nodes)
  -t, --time T             time limit (e.g. 12:00:00)
  -p, --partition P        partition
  -A, --account A          account
  -J, --job_name NAME      job name (default zerorun)
  -o, --output FILE        output file (default zerorun-%j.out)
  --sbatch_args ARGS       more sbatch options, shell-quoted ('--qos high --exclusive')
  --script FILE            also write the batch script to FILE
  --dry-run                print the batch script; submit nothing
  -h, --help               this help
"""

_VALUED = {
    "-N": "nodes", "--nodes": "nodes",
    "--gpus_per_node": "gpus_per_node", "--gpus-per-node": "gpus_per_node",
    "--ntasks_per_node": "ntasks_per_node", "--ntasks-per-node": "ntasks_per_node",
    "-t": "time", "--time": "time",
    "-p": "partition", "--partition": "partition",
    "-A": "account", "--account": "account",
    "-J": "job_name", "--job_name": "job_name", "--job-name": "job_name",
    "-o": "output", "--output": "output",
    "--sbatch_args": "sbatch_args", "--sbatch-args": "sbatch_args",
    "--script": "script",
}  # fmt: skip


@dataclass
class SbatchOptions:
    nodes: int | None = None
    gpus_per_node: int | None = None
    ntasks_per_node: int | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    job_name: str = "zerorun"
    output: str = "zerorun-%j.out"
    sbatch_args: str | None = None
    script: str | None = None
    dry_run: bool = False
    command: list[str] = field(default_factory=list)  # the zerorun command line


def parse_args(argv: Sequence[str]) -> SbatchOptions:
    """Our options first; the first argument that is not one of them starts the zerorun
    command line (`--` may separate them explicitly)."""
    opts = SbatchOptions()
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            i += 1
            break
        name, eq, value = arg.partition("=")
        if name in _VALUED:
            if not eq:
                if i + 1 >= len(args):
                    raise LaunchError(f"zerorun sbatch: {name} needs a value.")
                value = args[i + 1]
                i += 1
            key = _VALUED[name]
            if key in ("nodes", "gpus_per_node", "ntasks_per_node"):
                if not value.isdigit() or int(value) < 1:
                    raise LaunchError(f"zerorun sbatch: {name} {value!r} is not a positive whole number.")
                setattr(opts, key, int(value))
            else:
                setattr(opts, key, value)
            i += 1
            continue
        if arg in ("--dry-run", "--dry_run"):
            opts.dry_run = True
            i += 1
            continue
        break
    opts.command = args[i:]
    if opts.nodes is None:
        raise LaunchError("zerorun sbatch: give the number of nodes with -N/--nodes.")
    if not opts.command:
        raise LaunchError("zerorun sbatch: give the zerorun command to run (SCRIPT [ARGS...]).")
    if _launcher_options(opts.command) & {"--launcher", "--nnodes", "--node-rank", "--hostfile"}:
        raise LaunchError(
            "zerorun sbatch runs zerorun inside the allocation with the slurm launcher; leave out "
            "--launcher/--nnodes/--node_rank/--hostfile."
        )
    return opts


def _launcher_options(command: Sequence[str]) -> set[str]:
    """The launch options of a zerorun command line (`--name` or `--name=value`, underscores
    as hyphens), up to its script: the script's own arguments may be called anything."""
    from zerorun.cli.launch_cmd import normalize_argv

    argv = normalize_argv(command)
    ours = argv[: argv.index("--")] if "--" in argv else argv
    return {a.split("=", 1)[0] for a in ours if a.startswith("--")}


def batch_script(opts: SbatchOptions, *, python: str, cwd: str) -> str:
    from zerorun import __version__

    directives = [f"--job-name={opts.job_name}", f"--nodes={opts.nodes}", f"--output={opts.output}"]
    tasks = opts.ntasks_per_node or opts.gpus_per_node
    if tasks is not None:
        directives.append(f"--ntasks-per-node={tasks}")
    if opts.gpus_per_node is not None:
        directives.append(f"--gpus-per-node={opts.gpus_per_node}")
    for key in ("time", "partition", "account"):
        value = getattr(opts, key)
        if value is not None:
            directives.append(f"--{key}={value}")
    extra: list[str] = []
    if opts.sbatch_args:
        try:
            extra = shlex.split(opts.sbatch_args)
        except ValueError as err:
            raise LaunchError(f"zerorun sbatch: --sbatch_args {opts.sbatch_args!r}: {err}.") from None
    lines = [
        "#!/bin/bash",
        f"# Written by `zerorun sbatch` (zerorun {__version__}): the same zerorun command, run in the allocation;",
        "# zerorun starts every node through srun from there (docs/clusters.md).",
        *(f"#SBATCH {shlex.quote(d)}" for d in directives),
        *([f"#SBATCH {shlex.join(extra)}"] if extra else []),
        "set -euo pipefail",
        f"cd {shlex.quote(cwd)}",
        f"exec {shlex.quote(python)} -m zerorun {shlex.join(opts.command)}",
    ]
    return "\n".join(lines) + "\n"


@report_errors
def _run(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        return 0
    opts = parse_args(argv)
    text = batch_script(opts, python=sys.executable, cwd=os.getcwd())
    if opts.script:
        try:
            with open(opts.script, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.chmod(opts.script, 0o755)
        except OSError as err:
            raise LaunchError(f"zerorun sbatch: cannot write {opts.script}: {err.strerror or err}.") from None
    if opts.dry_run:
        sys.stdout.write(text)
        return 0
    try:
        proc = subprocess.run(["sbatch", "--parsable"], input=text, text=True, capture_output=True, check=False)
    except FileNotFoundError:
        raise LaunchError("zerorun sbatch: sbatch is not installed here (Slurm's client tools).") from None
    if proc.returncode != 0:
        raise LaunchError(f"sbatch failed (exit {proc.returncode}; with --wait, the job's): {proc.stderr.strip() or proc.stdout.strip()}")
    job = proc.stdout.strip().split(";")[0]
    sys.stdout.write(f"zerorun: submitted batch job {job} ({opts.nodes} node(s)); output in {opts.output.replace('%j', job)}\n")
    if proc.stderr.strip():
        sys.stderr.write(proc.stderr)
    return 0


class _App:
    def __call__(self, args: Sequence[str] | None = None, prog_name: str = "zerorun sbatch") -> None:
        del prog_name
        raise SystemExit(_run(list(sys.argv[1:] if args is None else args)))


app = _App()
