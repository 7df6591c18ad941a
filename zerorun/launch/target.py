"""Checking what the ranks will run (SCRIPT or `-m MODULE`) before anything starts.

Pure file-system checks (no package code runs in the launcher, no torch): a missing or
non-Python script, a directory without `__main__.py`, a syntax error, an unimportable module.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from zerorun.errors import LaunchError
from zerorun.launch.plan import Target, is_python_file

__all__ = ["check_target"]


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
