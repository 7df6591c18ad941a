"""`zerorun.checkpoint` (config/zerorun_section.py) and what the runtime makes of it
(runtime/checkpoint/options.py), DeepSpeed's `checkpoint.writer` notice; pure, no processes."""

from __future__ import annotations

import pytest

from zerorun.config import load_config
from zerorun.errors import ConfigError, RuntimeConfigError
from zerorun.runtime.checkpoint.options import CheckpointOptions, checkpoint_options
from zerorun.runtime.settings import CheckpointSettings, settings_from_config

BASE = {"train_micro_batch_size_per_gpu": 1}


def test_checkpoint_section_keys() -> None:
    cfg = load_config({**BASE, "zerorun": {"checkpoint": {"dir": "/c", "auto_resume": True, "every_n_steps": 5e2, "async": True}}}).config
    section = cfg.zerorun.checkpoint
    assert (section.dir, section.auto_resume, section.every_n_steps, section.keep_last) == ("/c", True, 500, 0)
    assert getattr(section, "async") is True
    # the JSON the ranks get keeps the key's own name
    assert cfg.to_dict()["zerorun"]["checkpoint"]["async"] is True


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ({"asynch": True}, "Did you mean 'async'"),
        ({"every_n_steps": -1}, "every_n_steps"),
        ({"async": "yes"}, "async"),
    ],
)
def test_checkpoint_section_mistakes(section: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config({**BASE, "zerorun": {"checkpoint": section}})


def test_deepspeed_checkpoint_writer_points_to_async() -> None:
    loaded = load_config({**BASE, "checkpoint": {"writer": {"type": "fast", "io_buffer_size": 1000}}})
    assert any("checkpoint.writer" in n and "zerorun.checkpoint.async" in n for n in loaded.notices), loaded.notices


def _settings(section: dict | None) -> CheckpointSettings:
    """RuntimeSettings.checkpoint for a `zerorun:` section, as initialize builds it."""
    cfg = load_config({**BASE, "zerorun": section or {}}).config
    return settings_from_config(cfg, world_size=1).checkpoint


def test_options_from_the_section_and_the_launcher() -> None:
    section = {"checkpoint": {"dir": "/c", "every_n_steps": 2, "async": True}}
    assert checkpoint_options(_settings(section), env={}) == CheckpointOptions(
        dir="/c",
        auto_resume=False,
        every_n_steps=2,
        keep_last=0,
        async_save=True,
        resume_from=None,
        save_on_preemption=False,
    )
    opts = checkpoint_options(_settings(section), env={"ZERORUN_RESUME_FROM": "/r", "ZERORUN_SAVE_ON_PREEMPTION": "1"})
    assert (opts.load_dir, opts.save_dir, opts.save_on_preemption, opts.active) == ("/r", "/c", True, True)
    # --resume_from alone: load from there, and save there
    opts = checkpoint_options(_settings(None), env={"ZERORUN_RESUME_FROM": "/r"})
    assert (opts.load_dir, opts.save_dir, opts.active) == ("/r", "/r", False)
    # auto_resume without a directory loads nothing
    assert checkpoint_options(_settings({"checkpoint": {"dir": "/c"}}), env={}).load_dir is None


def test_preemption_variable_without_a_directory_is_an_error_naming_the_fix() -> None:
    # The config's own keys are load_config's rule (tests/config/test_checkpoint_dir_rule.py); the
    # runtime still sees ZERORUN_SAVE_ON_PREEMPTION set by hand (a torchrun job), with the same text.
    with pytest.raises(RuntimeConfigError, match="--save_on_preemption.*needs a checkpoint directory.*zerorun.checkpoint.dir"):
        checkpoint_options(_settings(None), env={"ZERORUN_SAVE_ON_PREEMPTION": "1"})
