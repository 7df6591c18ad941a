"""The monitor / profiler / activation-checkpointing sections: acted on (no notices), and a
monitor enabled without its package is a config error before any rank starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zerorun.config import load_config
from zerorun.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
# The check looks for the package without importing it; `sys.modules[name] = None` makes
# importlib.util.find_spec report it absent, whether or not it is installed here.
HIDE_COMET = "import sys; sys.modules['comet_ml'] = None\n"


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


def test_monitor_without_its_package_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "comet_ml", None)
    with pytest.raises(ConfigError) as info:
        load_config({"comet": {"enabled": True}})
    text = str(info.value)
    assert "comet.enabled = true but the 'comet-ml' package is not installed" in text
    assert "pip install comet-ml" in text
    load_config({"comet": {"enabled": False}})  # disabled: nothing needed


def test_launcher_refuses_before_starting_ranks(tmp_path: Path) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"comet": {"enabled": True}}))
    marker = tmp_path / "started"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    argv = ["--num_gpus", "1", "--device", "cpu", "--config", str(cfg), str(script)]
    code = HIDE_COMET + f"from zerorun.cli import main\nmain({argv!r})\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "comet.enabled" in out and "comet-ml" in out and "Traceback" not in out
    assert not marker.exists()
