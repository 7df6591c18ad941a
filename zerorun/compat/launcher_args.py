"""The `deepspeed` command line -> zerorun's (``zerorun compat install`` makes ``deepspeed``
this): ``deepspeed [launcher options] SCRIPT [script args]`` becomes
``zerorun --deepspeed-compat [zerorun options] SCRIPT [script args]``. Pure, stdlib only.

DeepSpeed's launcher options that zerorun has under the same name pass through (zerorun accepts
both spellings of every option; DeepSpeed's short ``-H`` / ``-i`` / ``-e`` are ``--hostfile`` /
``--include`` / ``--exclude``, ``--ssh_port`` is zerorun's ``--ssh-port``: the port of every
node). The others are mapped (``--launcher pdsh`` -> ``ssh``,
``openmpi`` -> ``mpi``, ``--launcher_args`` -> ``--slurm-args`` / ``--mpi-args``) or refused with
what to do instead -- never dropped silently.
"""

from __future__ import annotations

__all__ = ["LauncherArgsError", "translate"]

# DeepSpeed option -> zerorun option, and whether it takes a value.
_SAME: dict[str, bool] = {
    "--hostfile": True, "--include": True, "--exclude": True, "--num_gpus": True, "--num_nodes": True,
    "--master_port": True, "--master_addr": True, "--module": False, "--no_local_rank": False,
    "--node_rank": True, "--ssh_port": True,
}
# DeepSpeed's short options (its runner's argparse): -H FILE, -i SELECTOR, -e SELECTOR.
_SHORT = {"-H": "--hostfile", "-i": "--include", "-e": "--exclude"}
_LAUNCHERS = {"pdsh": "ssh", "ssh": "ssh", "openmpi": "mpi", "slurm": "slurm"}
_IGNORED_FLAGS = {"--force_multi", "--enable_each_rank_log"}  # meaningless or default in zerorun (said on stderr)
_REFUSED: dict[str, str] = {
    "--no_python": "zerorun runs Python scripts and modules only",
    "--no_ssh_check": "zerorun checks every node before starting ranks; there is no switch",
    "--elastic_training": "elastic training is not supported by zerorun",
    "--autotuning": "DeepSpeed's autotuner is not part of zerorun",
    "--bind_cores_to_rank": "not supported by zerorun; set OMP_NUM_THREADS / taskset yourself",
    "--bind_core_list": "not supported by zerorun",
    "--save_pid": "not supported by zerorun; the launcher's PID is the job's",
    "--no_ssh": "use zerorun's per-node mode instead (--nnodes N --node_rank R on every node)",
    "--min_elastic_nodes": "elastic training is not supported by zerorun",
    "--max_elastic_nodes": "elastic training is not supported by zerorun",
    "--venv_script": "use --env KEY=VAL (zerorun) or .zerorun_env on the nodes",
    "--comment": "not supported by zerorun (Slurm's --comment: pass it with --launcher_args)",
    "--ucx_args": "zerorun's mpi launcher does not take UCX arguments",
}


class LauncherArgsError(ValueError):
    """A DeepSpeed launcher option zerorun does not take; the message says what to do."""


def _split(arg: str) -> tuple[str, str | None]:
    for short, long in _SHORT.items():
        if arg == short:
            return long, None
        if arg.startswith(short) and not arg.startswith("--"):  # -Hhostfile, as argparse takes it
            return long, arg[len(short) :].removeprefix("=")
    if arg.startswith("--") and "=" in arg:
        name, value = arg.split("=", 1)
        return name.replace("-", "_").replace("__", "--", 1), value
    return arg.replace("-", "_").replace("__", "--", 1) if arg.startswith("--") else arg, None


def translate(argv: list[str]) -> tuple[list[str], list[str]]:
    """(zerorun's argv after ``zerorun``, notes to print) for DeepSpeed's ``argv`` (after ``deepspeed``)."""
    out = ["--deepspeed-compat"]
    notes: list[str] = []
    launcher: str | None = None
    launcher_args: str | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-") or arg == "--":
            break  # the script; the rest is its own
        name, value = _split(arg)
        takes = _SAME.get(name)
        if name in ("--launcher", "--launcher_args"):
            if value is None:
                i += 1
                if i >= len(argv):
                    raise LauncherArgsError(f"deepspeed {name} needs a value")
                value = argv[i]
            if name == "--launcher":
                launcher = value.lower()
            else:
                launcher_args = value
        elif takes is not None:
            if takes and value is None:
                i += 1
                if i >= len(argv):
                    raise LauncherArgsError(f"deepspeed {name} needs a value")
                value = argv[i]
            out += [name] if not takes else [name, value or ""]
        elif name in _IGNORED_FLAGS:
            notes.append(f"deepspeed {name}: nothing to do in zerorun (every rank's output reaches the console; "
                         "--log-dir keeps a log per rank)")
        elif name in _REFUSED:
            raise LauncherArgsError(f"deepspeed {name} is not supported by zerorun: {_REFUSED[name]}")
        else:
            raise LauncherArgsError(
                f"deepspeed option {arg} is not one zerorun maps; run `zerorun --help` for zerorun's launcher "
                "options (docs/migration-from-deepspeed.md has the table)"
            )
        i += 1
    if launcher is not None:
        if launcher not in _LAUNCHERS:
            raise LauncherArgsError(
                f"deepspeed --launcher {launcher}: zerorun starts nodes with ssh (DeepSpeed's pdsh), mpi (openmpi) or "
                "slurm; mvapich/mpich/impi are not supported"
            )
        out += ["--launcher", _LAUNCHERS[launcher]]
    if launcher_args is not None:
        if launcher in ("slurm", "openmpi"):
            out += ["--slurm-args" if launcher == "slurm" else "--mpi-args", launcher_args]
        else:
            raise LauncherArgsError(
                "deepspeed --launcher_args: zerorun takes extra arguments for --launcher slurm or openmpi only"
            )
    if i >= len(argv):
        raise LauncherArgsError("deepspeed: no script given (deepspeed [options] SCRIPT [args])")
    if argv[i] == "--":
        i += 1
    return out + argv[i:], notes
