"""`zerorun env`: what a user pastes into a bug report.

Versions (zerorun, Python, torch, CUDA, cuDNN, NCCL, the CLI libraries), GPUs and their
memory, /dev/shm size (too small a /dev/shm kills ranks with SIGBUS), host memory and CPUs,
and the NCCL_* / GLOO_* / CUDA_* / TORCH_* variables visible to the launcher.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from typing import Annotated, Any

import typer

from zerorun.cli.config_cmds import BothSpellings
from zerorun.cli.errors import report_errors

__all__ = ["app", "collect_env"]

app = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)

_VARIABLE_PREFIXES = ("NCCL_", "GLOO_", "CUDA_", "TORCH_", "OMP_", "PYTORCH_", "ZERORUN_", "MASTER_", "LD_LIBRARY_PATH")
_LIBRARIES = ("typer", "rich", "pydantic", "pyyaml", "paramiko", "psutil", "numpy", "safetensors")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _torch_info() -> dict[str, Any]:
    try:
        import torch
    except Exception as err:  # a broken install is exactly what this report must show
        return {"torch": None, "torch_error": f"{type(err).__name__}: {err}"}
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cudnn": None,
        "nccl": None,
        "distributed_backends": [
            name for name in ("gloo", "nccl", "mpi") if getattr(torch.distributed, f"is_{name}_available", lambda: False)()
        ],
        "gpus": [],
    }
    try:
        info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:
        info["cudnn"] = None
    if torch.cuda.is_available():
        try:
            version = torch.cuda.nccl.version()
            info["nccl"] = ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
        except Exception as err:
            info["nccl"] = f"unknown ({err})"
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            info["gpus"].append(
                {
                    "index": i,
                    "name": props.name,
                    "memory_bytes": int(props.total_memory),
                    "capability": f"{props.major}.{props.minor}",
                    "bf16": bool(props.major >= 8),
                }
            )
    return info


def _shm() -> dict[str, Any] | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return {"total_bytes": st.f_blocks * st.f_frsize, "free_bytes": st.f_bavail * st.f_frsize}


def _host() -> dict[str, Any]:
    out: dict[str, Any] = {"cpus": os.cpu_count(), "memory_bytes": None, "available_bytes": None}
    try:
        import psutil

        vm = psutil.virtual_memory()
        out["memory_bytes"], out["available_bytes"] = int(vm.total), int(vm.available)
        out["usable_cpus"] = len(psutil.Process().cpu_affinity() or []) if hasattr(psutil.Process(), "cpu_affinity") else None
    except Exception:
        pass
    return out


def _memlock() -> int | None:
    """`ulimit -l` in bytes (None: unlimited): pinned offload buffers count against it."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _nvidia_driver() -> str | None:
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            first = f.readline()
    except OSError:
        return None
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ..."
    parts = first.split()
    return next((p for p in parts if p.count(".") >= 1 and p.replace(".", "").isdigit()), first.strip() or None)


def collect_env() -> dict[str, Any]:
    """Everything the report shows, as plain data (also the `--json` output)."""
    from zerorun._version import __version__
    from zerorun.launch.environment import redact_env

    return {
        "zerorun": __version__,
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "hostname": platform.node(),
        **_torch_info(),
        "libraries": {name: _version(name) for name in _LIBRARIES},
        "nvidia_driver": _nvidia_driver(),
        "host": _host(),
        "dev_shm": _shm(),
        "memlock_limit_bytes": _memlock(),
        # Pasted into bug reports: secret-looking values (tokens, keys, passwords) are redacted.
        "environment": redact_env(
            {k: v for k, v in sorted(os.environ.items()) if k.startswith(_VARIABLE_PREFIXES)}
        ),
    }


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


@app.command(cls=BothSpellings)
@report_errors
def env(as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False) -> None:
    """Report versions, GPUs, /dev/shm and NCCL variables (paste it into bug reports)."""
    info = collect_env()
    if as_json:
        print(json.dumps(info, indent=2))
        return
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 200
    rows: list[tuple[str, str]] = [
        ("zerorun", info["zerorun"]),
        ("python", f"{info['python']} ({info['python_executable']})"),
        ("platform", info["platform"]),
        ("torch", info["torch"] or f"not importable: {info.get('torch_error')}"),
    ]
    if info["torch"]:
        rows += [
            ("CUDA (torch build)", str(info["torch_cuda_build"] or "none (CPU build)")),
            ("CUDA available", str(info["cuda_available"]).lower()),
            ("cuDNN", str(info["cudnn"] or "-")),
            ("NCCL", str(info["nccl"] or "-")),
            ("NVIDIA driver", str(info["nvidia_driver"] or "-")),
            ("distributed backends", ", ".join(info["distributed_backends"]) or "-"),
        ]
        gpus = info["gpus"]
        rows.append(("GPUs", str(len(gpus)) if gpus else "none"))
        for gpu in gpus:
            rows.append((f"  cuda:{gpu['index']}", f"{gpu['name']}, {_gib(gpu['memory_bytes'])}, sm {gpu['capability']}"))
    host = info["host"]
    rows.append(("host", f"{host['cpus']} CPUs, {_gib(host['memory_bytes'])} memory ({_gib(host['available_bytes'])} available)"))
    shm = info["dev_shm"]
    if shm is None:
        rows.append(("/dev/shm", "missing (NCCL and data loaders need it)"))
    else:
        small = " -- small: NCCL may die with SIGBUS; in docker use --shm-size=8g or --ipc=host" if shm["total_bytes"] < 2**30 else ""
        rows.append(("/dev/shm", f"{_gib(shm['total_bytes'])} ({_gib(shm['free_bytes'])} free){small}"))
    memlock = info["memlock_limit_bytes"]
    rows.append(("ulimit -l", "unlimited" if memlock is None else f"{memlock / 2**20:.0f} MiB (pinned offload buffers count against it)"))
    rows.append(("libraries", ", ".join(f"{k} {v}" for k, v in info["libraries"].items() if v)))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        console.print(f"{key.ljust(width)}  {escape(str(value))}")
    variables = info["environment"]
    console.print(f"{'environment'.ljust(width)}  {'(no NCCL_/GLOO_/CUDA_/TORCH_ variables set)' if not variables else ''}")
    for key, value in variables.items():
        console.print(f"  {key}={escape(value)}")
