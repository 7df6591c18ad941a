"""examples/toy.py through the real launcher: `zerorun --num_gpus 2 examples/toy.py --config ...`."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ._spawn import REPO


@pytest.mark.parametrize("template", ["templates/zero2.yaml", "templates/zero1.json"])
def test_toy_example_through_launcher(template: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("ZERORUN_EVENT_FD", None)
    cmd = [
        sys.executable,
        "-m",
        "zerorun",
        "--num_gpus",
        "2",
        "--device",
        "cpu",
        "examples/toy.py",
        "--config",
        template,
        "--hidden",
        "32",
        "--layers",
        "2",
        "--samples",
        "256",
        "--epochs",
        "2",
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150, start_new_session=True
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    losses = [float(x) for x in re.findall(r"epoch \d+: loss ([0-9.]+)", out)]
    assert len(losses) == 2, out[-4000:]
    # Both ranks report their runtime memory to the launcher's table.
    assert "optimizer_states" in out


def test_gpt_example_as_a_plain_script() -> None:
    """examples/gpt.py without any launcher (one process, no rendezvous variables): the README's
    model, the template's optimizer replaced by --lr's AdamW + schedule, and it learns."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("ZERORUN_", "RANK", "WORLD_SIZE", "MASTER_"))
    }
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [
        sys.executable,
        "examples/gpt.py",
        "--config",
        "templates/zero2.yaml",
        "--steps",
        "4",
        "--lr",
        "3e-3",
        "--warmup",
        "2",
        "--log_every",
        "1",
        "--seq_len",
        "32",
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, start_new_session=True
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "ZeRO stage 2, 1 rank(s) on cpu" in out, out[-2000:]
    losses = [float(x) for x in re.findall(r"step +\d+ +loss ([0-9.]+)", out)]
    assert len(losses) == 4 and losses[-1] < losses[0], out[-2000:]
