"""Running helpers for the compat tests: every subprocess has a deadline and one thread."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("ZERORUN_", "ACCELERATE_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        out.pop(name, None)
    out.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out["PYTHONPATH"] = str(ROOT) + os.pathsep + out.get("PYTHONPATH", "")
    out.update(extra)
    return out


def run(args: list[str], timeout: float, **extra: str) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` from the repository root; the output is shown when it fails."""
    proc = subprocess.run(
        [PYTHON, *args], cwd=ROOT, env=env(**extra), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def launch(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``zerorun --deepspeed-compat ARGS`` (the launcher, real ranks, gloo; CPU ranks even on a
    GPU machine, where the GPU checks are scripts/gpu_compat_checks.sh)."""
    return run(["-m", "zerorun", "--deepspeed-compat", *args], timeout, CUDA_VISIBLE_DEVICES="")
