"""The config knows, without torch, what the runtime builds: the tables agree with the runtime
and with torch's signatures, and the config rejects what initialize would reject on every rank."""

from __future__ import annotations

import inspect

import pytest

from zerorun.config import load_config
from zerorun.config.runtime_support import DEEPSPEED_ADAM_EXTRAS, OPTIMIZER_KWARGS, SCHEDULER_KWARGS
from zerorun.errors import ConfigError, RuntimeConfigError


def test_tables_match_the_runtime_and_torch():
    from zerorun.runtime.optimizer import ELEMENTWISE
    from zerorun.runtime.scheduler import SCHEDULERS

    assert {c.__name__ for c in ELEMENTWISE.values()} == set(OPTIMIZER_KWARGS)
    assert set(SCHEDULERS) == set(SCHEDULER_KWARGS)
    for cls in ELEMENTWISE.values():
        real = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
        assert real <= OPTIMIZER_KWARGS[cls.__name__], (cls.__name__, real - OPTIMIZER_KWARGS[cls.__name__])
    for name, cls in SCHEDULERS.items():
        real = set(inspect.signature(cls.__init__).parameters) - {"self", "optimizer"}
        assert real == SCHEDULER_KWARGS[name], name


def _error(config: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config)
    return str(info.value)


def test_optimizer_and_scheduler_the_runtime_cannot_build_are_errors():
    assert "zerorun does not build this optimizer" in _error({"optimizer": {"type": "Lamb"}})
    # the launcher sees a ConfigError; zerorun.initialize's callers a RuntimeConfigError
    with pytest.raises(RuntimeConfigError, match="Lamb"):
        load_config({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}})
    msg = _error({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decy": 0.1}}})
    assert "optimizer.params.weight_decy: not a parameter of AdamW. Did you mean 'weight_decay'?" in msg
    msg = _error({"scheduler": {"type": "OneCycle", "params": {}}})
    assert "zerorun does not build this scheduler" in msg and "lr_scheduler=callable(optimizer)" in msg
    assert "WarmupDecayLR needs total_num_steps" in _error({"scheduler": {"type": "WarmupDecayLR", "params": {}}})
    msg = _error({"scheduler": {"type": "WarmupLR", "params": {"warmup_max": 1e-3}}})
    assert "Did you mean 'warmup_max_lr'?" in msg
    msg = _error({"optimizer": {"type": "AdamW", "params": {"lr": -1, "betas": [0.9], "eps": "small"}}})
    assert "optimizer.params.lr = -1: must be a number ≥ 0" in msg and "must be two numbers in [0, 1)" in msg
    assert "optimizer.params.eps = 'small'" in msg
    assert "allowed: 'log', 'linear'" in _error({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cos"}}})
    # DeepSpeed's Adam extras and Hugging Face's "auto" values are fine
    ok = {"type": "Adam", "params": {"lr": "auto", "betas": "auto", "adam_w_mode": False, "torch_adam": True}}
    assert load_config({"optimizer": ok}).warnings == []
    assert set(DEEPSPEED_ADAM_EXTRAS) == {"adam_w_mode", "torch_adam"}
