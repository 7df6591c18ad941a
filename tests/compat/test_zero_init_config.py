"""``deepspeed.zero.Init``'s config (compat/deepspeed/runtime/zero/partition_parameters.py) is read
as zerorun's validated, typed settings -- whatever form it comes in -- not by string keys: the
parameters' dtype and the stage-3 check. In-process, no ranks (the training side of zero.Init is
tests/compat/test_peer_behaviours.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zerorun.compat.deepspeed.runtime.zero.partition_parameters import Init, init_dtype
from zerorun.config import load_config
from zerorun.errors import ConfigError, RuntimeConfigError

BASE = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}


class _HoldsConfig:  # transformers' HfDeepSpeedConfig keeps the dict in .config
    def __init__(self, config: dict) -> None:
        self.config = config


def test_dtype_follows_the_config_in_every_form(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(dict(BASE, fp16={"enabled": True})))
    cases = [
        (dict(BASE, bf16={"enabled": True}), torch.bfloat16),
        (dict(BASE, bfloat16={"enabled": True}), torch.bfloat16),  # DeepSpeed's older spelling
        (dict(BASE, fp16={"enabled": True}), torch.float16),
        (dict(BASE, bf16={"enabled": "auto"}, fp16={"enabled": "auto"}), torch.float32),  # "auto" is not enabled
        (BASE, torch.float32),
        (dict(BASE, steps_per_print=float("inf"), bf16={"enabled": True}), torch.bfloat16),  # accelerate's "never"
        (str(path), torch.float16),
        (path, torch.float16),
        (_HoldsConfig(dict(BASE, bf16={"enabled": True})), torch.bfloat16),
        (load_config(dict(BASE, bf16={"enabled": True})), torch.bfloat16),
        (load_config(dict(BASE, bf16={"enabled": True})).config, torch.bfloat16),
    ]
    for cfg, want in cases:
        assert init_dtype(cfg, None) == want, cfg
    assert init_dtype(dict(BASE, bf16={"enabled": True}), torch.float16) == torch.float16  # dtype= wins
    assert init_dtype(None, None) is None


def test_a_config_no_run_could_use_is_refused_with_the_loaders_message() -> None:
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        init_dtype({"zero_optimization": {"stage": "three"}}, None)
    with pytest.raises(RuntimeConfigError, match="config dict or a path"):
        init_dtype(42, None)


def test_stage_check_reads_the_validated_stage(tmp_path: Path) -> None:
    with pytest.raises(RuntimeConfigError, match="zero_optimization.stage 2"):
        Init(config_dict_or_path={"zero_optimization": {"stage": 2}})
    with pytest.raises(RuntimeConfigError, match="zero_optimization.stage 0"):
        Init(config=_HoldsConfig({"train_micro_batch_size_per_gpu": 1}))  # no section: stage 0, as validated
