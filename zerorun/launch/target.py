"""What the ranks will run (SCRIPT or `-m MODULE`), inspected before anything starts.

Pure file-system checks (no package code runs in the launcher, no torch): a missing or
non-Python script, a directory without `__main__.py`, a syntax error, an unimportable module;
and what the launcher reads from the script: a config file among its arguments
(`--deepspeed ds.json`), a declared `--local_rank` argument.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from zerorun.errors import LaunchError
from zerorun.launch.plan import LaunchOptions, Target

__all__ = [
    "check_target",
    "is_python_file",
    "find_config_argument",
    "CONFIG_ARGUMENTS",
    "declared_local_rank_arg",
    "local_rank_arg",
]


def check_target(target: Target) -> None:
    """A clear LaunchError, before any rank starts, when the script or module cannot run."""
    if target.module is not None:
        _check_module(target.module)
        return
    path = Path(str(target.script))
    if not path.exists():
        hint = ""
        if not str(target.script).endswith(".py") and Path(f"{target.script}.py").exists():
            hint = f" Did you mean {target.script}.py?"
        elif "." in str(target.script) and "/" not in str(target.script) and not str(target.script).endswith(".py"):
            hint = f" To run a module, write -m {target.script}."
        raise LaunchError(f"script {target.script} not found (working directory {os.getcwd()}).{hint}")
    if path.is_dir():
        if (path / "__main__.py").is_file():
            return  # python DIR runs DIR/__main__.py
        raise LaunchError(f"{target.script} is a directory without __main__.py; give the script inside it.")
    if not is_python_file(path):
        raise LaunchError(
            f"{target.script} is not a Python file (no .py suffix, no python #! line). zerorun runs "
            "Python scripts in every rank; for a module use -m NAME."
        )
    if not os.access(path, os.R_OK):
        raise LaunchError(f"script {target.script} is not readable (check its permissions).")
    try:
        # Compiling costs milliseconds; a syntax error found here starts no rank at all.
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    except SyntaxError as err:
        where = f"{err.filename}:{err.lineno}" + (f":{err.offset}" if err.offset else "")
        line = f"\n    {err.text.rstrip()}" if err.text else ""
        raise LaunchError(f"{where}: {err.msg} (the script does not compile; no rank was started){line}") from None
    except (OSError, ValueError):
        pass  # unreadable or NUL bytes: let python report it in the rank


def _check_module(module: str) -> None:
    """Is `module` importable from here, as the ranks will see it (cwd first on sys.path)?
    Walks the file system instead of importing, so no package code runs in the launcher."""
    parts = module.split(".")
    if not all(p.isidentifier() for p in parts):
        raise LaunchError(f"-m {module}: not a module name (dotted Python identifiers, e.g. pkg.train).")
    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path.pop(0)
    if spec is None:
        raise LaunchError(f"-m {module}: no module named {parts[0]!r} (searched the working directory and sys.path).")
    locations = list(spec.submodule_search_locations or [])
    for depth, part in enumerate(parts[1:], start=1):
        found = None
        for loc in locations:
            base = Path(loc) / part
            if (base / "__init__.py").is_file() or base.is_dir():
                found = [str(base)]
                break
            if base.with_suffix(".py").is_file():
                found = []
                break
        if found is None:
            raise LaunchError(f"-m {module}: no module named {'.'.join(parts[: depth + 1])!r}.")
        locations = found


def is_python_file(path: Path) -> bool:
    return path.suffix in (".py", ".pyw") or _has_python_shebang(path)


def _has_python_shebang(path: Path) -> bool:
    try:
        with path.open("rb") as fh:
            first = fh.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


# Script arguments that carry a DeepSpeed config (`train.py --deepspeed ds.json`): the launcher
# validates that file too, and passes the argument on unchanged.
CONFIG_ARGUMENTS = ("--deepspeed_config", "--deepspeed-config", "--deepspeed", "--config")
_CONFIG_SUFFIXES = (".json", ".yaml", ".yml")


def find_config_argument(args: Sequence[str]) -> tuple[str, str] | None:
    """(flag, path) of the first config argument of the script, or None.

    `--deepspeed` is also a plain switch in DeepSpeed's own argument parser (with the file in
    `--deepspeed_config`), so a value counts only when it looks like a config file: no
    leading '-', and an existing file or a .json/.yaml/.yml name.
    """
    found: dict[str, str] = {}
    for i, arg in enumerate(args):
        if arg == "--":
            break
        name, eq, value = arg.partition("=")
        if name not in CONFIG_ARGUMENTS or name in found:
            continue
        if not eq:
            if i + 1 >= len(args):
                continue
            value = args[i + 1]
        if not value or value.startswith("-"):
            continue
        if not (value.endswith(_CONFIG_SUFFIXES) or Path(value).is_file()):
            continue
        found[name] = value
    for name in CONFIG_ARGUMENTS:
        if name in found:
            return name, found[name]
    return None


_LOCAL_RANK_DECL = re.compile(r"""add_argument\(\s*(?:['"]-[\w-]*['"]\s*,\s*)?['"](--local[_-]rank)['"]""")


def declared_local_rank_arg(source: str) -> str | None:
    """`--local_rank` (or `--local-rank`) if the script's source declares it with argparse:
    DeepSpeed-era scripts expect the launcher to pass it, and accept it when passed."""
    m = _LOCAL_RANK_DECL.search(source)
    return m.group(1) if m else None


def local_rank_arg(options: LaunchOptions) -> str | None:
    """The `--local_rank` spelling to pass the script, or None to pass none."""
    if not options.pass_local_rank:
        return None
    # DeepSpeed's launcher passes --local_rank=N to every script; with --deepspeed-compat so do
    # we (HF scripts take it through TrainingArguments, not an add_argument we could see).
    fallback = "--local_rank" if options.deepspeed_compat else None
    if options.target.script is None:
        return fallback
    path = Path(options.target.script)
    if path.is_dir():
        path = path / "__main__.py"
    try:
        return declared_local_rank_arg(path.read_text(encoding="utf-8", errors="replace")) or fallback
    except OSError:
        return fallback
