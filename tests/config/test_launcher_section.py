"""config/launcher_section.py: the config's `launcher:` section takes what the command line takes
(`launcher.launcher: sim` was refused by the schema while `--launcher sim` worked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from zerorun.config import LauncherSection, load_config
from zerorun.errors import ConfigError
from zerorun.launch.selection import LAUNCHERS


def test_the_config_and_the_command_line_take_the_same_launchers() -> None:
    annotation = LauncherSection.model_fields["launcher"].annotation
    (literal,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    assert set(typing.get_args(literal)) == set(LAUNCHERS)
    for name in LAUNCHERS:
        assert load_config({"launcher": {"launcher": name}}).config.launcher.launcher == name
    with pytest.raises(ConfigError, match="launcher.launcher"):
        load_config({"launcher": {"launcher": "pdsh"}})


def test_sim_in_a_config_says_the_script_does_not_run() -> None:
    warnings = load_config({"launcher": {"launcher": "sim"}}).warnings
    assert any("launcher.launcher = 'sim'" in w and "the script does not run" in w for w in warnings), warnings
    assert not any("sim" in w for w in load_config({"launcher": {"launcher": "ssh"}}).warnings)


def test_launcher_sim_from_the_config_runs_the_simulation(tmp_path: Path) -> None:
    """The whole CLI pipeline with the launcher and hostfile from the config alone: the simulated
    nodes run and exit 0 (the script itself would fail: it never runs)."""
    (tmp_path / "hosts").write_text("n0 slots=2\nn1 slots=2\n")
    (tmp_path / "train.py").write_text("raise SystemExit('never runs: the ranks are synthetic')\n")
    (tmp_path / "c.yaml").write_text("train_micro_batch_size_per_gpu: 1\nlauncher: {launcher: sim, hostfile: hosts}\n")
    (tmp_path / "sc.json").write_text(json.dumps({"line_rate": 2, "event_interval_s": 0, "duration_s": 0.5}))
    env = {**os.environ, "ZERORUN_SIM_SCENARIO": str(tmp_path / "sc.json"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "zerorun", "--config", "c.yaml", "train.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "launcher sim:" in proc.stderr and "the script does not run" in proc.stderr, proc.stderr
    assert "never runs" not in proc.stdout + proc.stderr
