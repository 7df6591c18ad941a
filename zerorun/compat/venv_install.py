"""``zerorun compat install | uninstall | status``: make the current virtual environment's
``import deepspeed`` and ``deepspeed`` command be zerorun's (opt-in; stdlib only).

``zerorun --deepspeed-compat`` activates the layer in its own ranks only; programs those ranks
start (``accelerate launch ...``, ``deepspeed ...``, test suites spawning workers) do not see it.
``install`` writes, in this environment (a virtual environment only, never the system Python):

* ``site-packages/zerorun_deepspeed_compat.pth``: one ``import`` line, run by Python at every
  start in this environment, that activates the layer (``zerorun.compat.activate``; stdlib
  only, so start-up stays fast; nothing else is imported until a program imports deepspeed);
* ``bin/deepspeed``: DeepSpeed's command, mapped onto zerorun's launcher (launcher_args.py);
* ``site-packages/deepspeed-<COMPAT_VERSION>.dist-info/`` (INSTALLER ``zerorun``, a RECORD of the
  three): so ``pip list`` shows ``deepspeed 0.16.4+zerorun`` and ``pip uninstall deepspeed``
  removes exactly these files, as ``zerorun compat uninstall`` does.

It refuses when a real DeepSpeed is installed in the environment (uninstall it first, or keep
it and use ``zerorun --deepspeed-compat``, which uses the layer inside its ranks regardless).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import stat
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from zerorun.compat.activation import COMPAT_VERSION, INSTALLER, is_ours

__all__ = ["INSTALLER", "InstallError", "Layout", "layout", "install", "uninstall", "status", "is_ours"]

PTH_NAME = "zerorun_deepspeed_compat.pth"
_PTH_LINE = (
    "import os, sys; exec(\"try:\\n import zerorun.compat as _z\\n _z.activate(announce=False, metadata=False)\\nexcept Exception:\\n pass\") "
    "if os.environ.get('ZERORUN_DEEPSPEED_COMPAT_OFF') != '1' else None\n"
)


class InstallError(RuntimeError):
    """What ``zerorun compat`` refuses, with the reason and the fix."""


@dataclass(frozen=True)
class Layout:
    prefix: Path
    site: Path
    bin: Path
    pth: Path = field(init=False)
    script: Path = field(init=False)
    dist_info: Path = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pth", self.site / PTH_NAME)
        object.__setattr__(self, "script", self.bin / "deepspeed")
        object.__setattr__(self, "dist_info", self.site / f"deepspeed-{COMPAT_VERSION}.dist-info")


def layout() -> Layout:
    """This interpreter's environment; an error when it is not a virtual environment."""
    if sys.prefix == sys.base_prefix:
        raise InstallError(
            f"{sys.executable} is not in a virtual environment: zerorun compat install changes only virtual "
            "environments (python -m venv ENV, then ENV/bin/zerorun compat install)"
        )
    paths = sysconfig.get_paths()
    return Layout(Path(sys.prefix), Path(paths["purelib"]), Path(paths["scripts"]))


def _deepspeed_dists(site: Path) -> list[importlib.metadata.Distribution]:
    """Distributions named deepspeed on disk in ``site`` (not the in-process layer's)."""
    return [d for d in importlib.metadata.distributions(path=[str(site)]) if (d.metadata["Name"] or "").lower() == "deepspeed"]


def real_deepspeed(site: Path) -> importlib.metadata.Distribution | None:
    return next((d for d in _deepspeed_dists(site) if not is_ours(d)), None)


def _record_line(path: Path, root: Path) -> str:
    data = path.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{os.path.relpath(path, root)},sha256={digest},{len(data)}"


def _script_text() -> str:
    return (
        f"#!{sys.executable}\n"
        "# DeepSpeed's launcher command, as zerorun's (zerorun compat install; zerorun compat uninstall removes it).\n"
        "import sys\n"
        "from zerorun.compat.deepspeed_command import main\n"
        "sys.exit(main())\n"
    )


def install() -> list[str]:
    """Install into this virtual environment; returns lines saying what changed."""
    where = layout()
    real = real_deepspeed(where.site)
    if real is not None:
        raise InstallError(
            f"a real DeepSpeed {real.version} is installed in {where.prefix} ({real.locate_file('')}): `pip uninstall "
            "deepspeed` first, or keep it and use `zerorun --deepspeed-compat`, which uses zerorun's layer inside its "
            "own ranks without touching the environment"
        )
    if where.script.exists() and not (where.dist_info / "RECORD").is_file():
        raise InstallError(f"{where.script} exists and is not zerorun's; move it away first")
    where.site.mkdir(parents=True, exist_ok=True)
    where.bin.mkdir(parents=True, exist_ok=True)
    where.pth.write_text(_PTH_LINE)
    where.script.write_text(_script_text())
    where.script.chmod(where.script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    info = where.dist_info
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: deepspeed\n"
        f"Version: {COMPAT_VERSION}\n"
        "Summary: zerorun's DeepSpeed compatibility layer, installed by `zerorun compat install` (not DeepSpeed)\n"
        "Author: zerorun\nLicense: Apache-2.0\n"
    )
    (info / "INSTALLER").write_text(INSTALLER + "\n")
    (info / "top_level.txt").write_text("deepspeed\n")
    files = [where.pth, where.script, info / "METADATA", info / "INSTALLER", info / "top_level.txt"]
    record = [_record_line(p, where.site) for p in files] + [f"{os.path.relpath(info / 'RECORD', where.site)},,"]
    (info / "RECORD").write_text("\n".join(record) + "\n")
    return [
        f"installed zerorun's DeepSpeed layer into {where.prefix}:",
        f"  {where.pth}  (every Python started here: `import deepspeed` is zerorun.compat.deepspeed {COMPAT_VERSION})",
        f"  {where.script}  (`deepspeed [launcher options] SCRIPT ...` runs `zerorun --deepspeed-compat ...`)",
        f"  {info}",
        f"pip list shows `deepspeed {COMPAT_VERSION}`; `pip uninstall deepspeed` or `zerorun compat uninstall` "
        "removes exactly these files.",
        "ZERORUN_DEEPSPEED_COMPAT_OFF=1 turns the import hook off for one command.",
    ]


def uninstall() -> list[str]:
    where = layout()
    ours = [d for d in _deepspeed_dists(where.site) if is_ours(d)]
    removed: list[str] = []
    for path in (where.pth, where.script):
        if path.exists() and (path is where.pth or (where.dist_info / "RECORD").is_file()):
            path.unlink()
            removed.append(str(path))
    if where.dist_info.is_dir():
        for child in where.dist_info.iterdir():
            child.unlink()
        where.dist_info.rmdir()
        removed.append(str(where.dist_info))
    if not removed and not ours:
        return [f"zerorun's DeepSpeed layer is not installed in {where.prefix}; nothing to do"]
    return [f"removed from {where.prefix}:", *(f"  {p}" for p in removed)]


def status() -> list[str]:
    where = layout()
    real = real_deepspeed(where.site)
    installed = where.pth.is_file() and (where.dist_info / "RECORD").is_file()
    lines = [f"environment: {where.prefix}"]
    if installed:
        lines.append(f"zerorun's DeepSpeed layer: installed ({COMPAT_VERSION}; {where.pth}, {where.script})")
    else:
        lines.append("zerorun's DeepSpeed layer: not installed (zerorun compat install)")
    lines.append(f"real DeepSpeed: {real.version} at {real.locate_file('')}" if real else "real DeepSpeed: none")
    return lines
