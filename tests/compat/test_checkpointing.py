"""`deepspeed.checkpointing` in the compatibility layer is zerorun.checkpointing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import zerorun.compat
zerorun.compat.activate(announce=False)
import deepspeed
import zerorun.checkpointing as zc
from deepspeed.checkpointing import checkpoint, configure
assert checkpoint is zc.checkpoint and configure is zc.configure
assert deepspeed.checkpointing.is_configured is zc.is_configured
try:
    deepspeed.checkpointing.get_cuda_rng_tracker
except AttributeError as e:
    assert "get_cuda_rng_tracker" in str(e), e
else:
    raise AssertionError("a missing name must raise")
print("OK")
"""


def test_deepspeed_checkpointing_is_zerorun_checkpointing() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stdout + proc.stderr
