"""The monitor / profiler / activation-checkpointing sections: acted on (no notices), and a
monitor enabled without its package is a config error before any rank starts."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from zerorun.config import load_config
from zerorun.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
MISSING = [
    (section, package)
    for section, module, package in (("wandb", "wandb", "wandb"), ("comet", "comet_ml", "comet-ml"))
    if importlib.util.find_spec(module) is None
]


def test_acted_on_keys_give_no_notice() -> None:
    loaded = load_config(
        {
            "steps_per_print": 5,
            "wall_clock_breakdown": True,
            "csv_monitor": {"enabled": True, "output_path": "x", "job_name": "j"},
            "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True},
        }
    )
    assert loaded.notices == [] and loaded.warnings == []


def test_keys_without_effect_are_noticed() -> None:
    loaded = load_config({"activation_checkpointing": {"contiguous_memory_optimization": True, "profile": True}})
    text = "\n".join(loaded.notices)
    assert "contiguous_memory_optimization = true: no effect; zerorun keeps each checkpointed activation" in text
    assert "profile" not in text  # acted on


@pytest.mark.skipif(not MISSING, reason="wandb and comet-ml are both installed here")
def test_monitor_without_its_package_is_a_config_error() -> None:
    section, package = MISSING[0]
    with pytest.raises(ConfigError) as info:
        load_config({section: {"enabled": True}})
    text = str(info.value)
    assert f"{section}.enabled = true but the {package!r} package is not installed" in text
    assert f"pip install {package}" in text
    load_config({section: {"enabled": False}})  # disabled: nothing needed


@pytest.mark.skipif(not MISSING, reason="wandb and comet-ml are both installed here")
def test_launcher_refuses_before_starting_ranks(tmp_path: Path) -> None:
    section, package = MISSING[0]
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({section: {"enabled": True}}))
    marker = tmp_path / "started"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    proc = subprocess.run(
        [sys.executable, "-m", "zerorun", "--num_gpus", "1", "--device", "cpu", "--config", str(cfg), str(script)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert f"{section}.enabled" in out and package in out and "Traceback" not in out
    assert not marker.exists()
