"""A checkpoint option that needs a directory, without one, is a config error before any rank
starts: load_config / `zerorun print-config` name the key and the fix, and the launcher checks its
--save_on_preemption / --resume_from flags against the config in plan_job (which starts nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerorun.cli import config_cmds
from zerorun.config import load_config
from zerorun.errors import ConfigError
from zerorun.launch.job import plan_job
from zerorun.launch.plan import LaunchOptions, Target
from zerorun.launch.restart import with_config_section

FIX = "needs a checkpoint directory: set zerorun.checkpoint.dir in the config (or launch with --resume_from DIR)"


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZERORUN_RESUME_FROM", raising=False)


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"zerorun": {"checkpoint": {"auto_resume": True}}}, "zerorun.checkpoint.auto_resume"),
        ({"zerorun": {"checkpoint": {"every_n_steps": 10}}}, "zerorun.checkpoint.every_n_steps"),
        ({"launcher": {"save_on_preemption": True}}, "launcher.save_on_preemption"),
    ],
)
def test_load_config_names_the_key_and_the_fix(section: dict, key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=f"{key}.* {FIX.replace('(', '.').replace(')', '.')}"):
        load_config(section)
    # a directory from anywhere satisfies it: the config's dir, its launcher.resume_from, the
    # launcher's --resume_from, or (in a rank) the ZERORUN_RESUME_FROM that flag became
    load_config({**section, "zerorun": {"checkpoint": {**section.get("zerorun", {}).get("checkpoint", {}), "dir": "c"}}})
    load_config({**section, "launcher": {**section.get("launcher", {}), "resume_from": "r"}})
    load_config(section, resume_from="/r")
    monkeypatch.setenv("ZERORUN_RESUME_FROM", "/r")
    load_config(section)


def test_print_config_reports_it_with_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("train_micro_batch_size_per_gpu: 1\nzerorun:\n  checkpoint:\n    every_n_steps: 5\n")
    with pytest.raises(SystemExit) as exc:
        config_cmds.app([str(p)], prog_name="zerorun")
    err = " ".join(capsys.readouterr().err.split())
    assert exc.value.code == 1
    assert f"zerorun.checkpoint.every_n_steps (line 4) {FIX}" in err and "Traceback" not in err


def test_the_launcher_checks_its_flags_against_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "plain.yaml").write_text("train_micro_batch_size_per_gpu: 1\nlauncher: {num_gpus: 1, device: cpu}\n")
    (tmp_path / "every.yaml").write_text(
        "train_micro_batch_size_per_gpu: 1\nlauncher: {num_gpus: 1, device: cpu}\nzerorun: {checkpoint: {every_n_steps: 2}}\n"
    )
    (tmp_path / "dir.yaml").write_text(
        "train_micro_batch_size_per_gpu: 1\nlauncher: {num_gpus: 1, device: cpu}\nzerorun: {checkpoint: {dir: ck}}\n"
    )

    def plan(config: str, **flags: object):
        return plan_job(LaunchOptions(target=Target(script="train.py"), config=config, **flags))  # type: ignore[arg-type]

    with pytest.raises(ConfigError, match=f"plain.yaml: launcher.save_on_preemption .--save_on_preemption. {FIX[:30]}"):
        plan("plain.yaml", save_on_preemption=True)
    with pytest.raises(ConfigError, match="every.yaml: zerorun.checkpoint.every_n_steps"):
        plan("every.yaml")
    # --resume_from gives the directory for both; so does the config's dir
    assert plan("plain.yaml", save_on_preemption=True, resume_from="r").plan.save_on_preemption
    assert plan("every.yaml", resume_from="r").plan.resume_from == str(tmp_path / "r")
    assert plan("dir.yaml", save_on_preemption=True).plan.save_on_preemption
    # no config the launcher knows: the script's own config decides, in the ranks
    assert plan_job(LaunchOptions(target=Target(script="train.py"), num_gpus=1, device="cpu", save_on_preemption=True))
    # the restart loop's own read of the config sees the flag too
    assert with_config_section(LaunchOptions(target=Target(script="train.py"), config="every.yaml", resume_from="r"))
