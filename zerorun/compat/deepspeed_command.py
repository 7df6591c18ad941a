"""The ``deepspeed`` command that ``zerorun compat install`` puts in a virtual environment:
DeepSpeed's launcher options mapped onto zerorun's launcher (launcher_args.py), then
``python -m zerorun --deepspeed-compat ...`` in this process's place."""

from __future__ import annotations

import os
import sys

from zerorun.compat.launcher_args import LauncherArgsError, translate

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["-h"], ["--help"]):
        sys.stdout.write(
            "deepspeed [launcher options] SCRIPT [args]: zerorun's launcher with --deepspeed-compat "
            "(zerorun compat install). Options: -H/--hostfile, -i/--include, -e/--exclude, --num_gpus, "
            "--num_nodes, --master_addr, --master_port, --ssh_port, --no_local_rank, --module, "
            "--launcher pdsh|openmpi|slurm, "
            "--launcher_args; `zerorun --help` lists zerorun's own.\n"
        )
        return 0
    try:
        zerorun_args, notes = translate(args)
    except LauncherArgsError as err:
        sys.stderr.write(f"deepspeed (zerorun): {err}\n")
        return 2
    for note in notes:
        sys.stderr.write(f"deepspeed (zerorun): {note}\n")
    os.execv(sys.executable, [sys.executable, "-m", "zerorun", *zerorun_args])
    return 0  # not reached
