"""zero_optimization.zenflow: every DeepSpeed ZenFlow key and its "auto" values accepted and
validated like DeepSpeed (ranges, strategy/interval rules); the section is not acted on yet,
which print-config's notices say."""

from __future__ import annotations

import pytest

from zerorun.config import load_config
from zerorun.errors import ConfigError

ALL_KEYS = {
    "topk_ratio": 0.05,
    "select_strategy": "step",
    "select_interval": 8,
    "update_interval": 4,
    "full_warm_up_rounds": 2,
    "overlap_step": True,
    "offload": True,
    "auto_ratio": 0.95,
    "pt_reserved_cores_perc": 0.25,
    "steps_per_epoch": 100,
}


def _load(zenflow: dict, device: str = "cpu", stage: int = 2):  # noqa: ANN202
    return load_config({"zero_optimization": {"stage": stage, "offload_optimizer": {"device": device}, "zenflow": zenflow}})


def test_every_deepspeed_key_is_accepted_and_noticed() -> None:
    loaded = _load(ALL_KEYS)
    zf = loaded.config.zero_optimization.zenflow
    assert {k: getattr(zf, k) for k in ALL_KEYS} == ALL_KEYS
    assert loaded.warnings == []
    assert loaded.notices == ["zero_optimization.zenflow: DeepSpeed section accepted; zerorun does not act on it"]
    defaults = _load({}).config.zero_optimization.zenflow  # DeepSpeed's defaults, "auto" intervals
    assert (defaults.topk_ratio, defaults.select_strategy, defaults.select_interval, defaults.update_interval) == (
        0.1, "auto", "auto", "auto",
    )  # fmt: skip
    autos = _load({"update_interval": "auto", "select_interval": "auto"})
    assert autos.open_autos == []  # resolved by ZenFlow's own rules, not by the script


@pytest.mark.parametrize(
    ("zenflow", "needle"),
    [
        ({"topk_ratio": 1.5}, "topk_ratio: 1.5 is not a fraction"),
        ({"auto_ratio": -0.1}, "auto_ratio: -0.1 is not a fraction"),
        ({"pt_reserved_cores_perc": 2}, "pt_reserved_cores_perc: 2.0 is not a fraction"),
        ({"update_interval": 0}, "update_interval: 0: give a whole number of at least 1"),
        ({"select_interval": "sometimes"}, "select_interval"),
        ({"select_strategy": "batch"}, "select_strategy"),
        ({"full_warm_up_rounds": -1}, "full_warm_up_rounds"),
        ({"topk": 0.1}, "unknown key"),
        ({"select_strategy": "step"}, "needs a number in zero_optimization.zenflow.select_interval"),
        ({"select_strategy": "step", "select_interval": 2, "update_interval": 4}, "is below"),
    ],
)
def test_mistakes_are_clear_errors(zenflow: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load(zenflow)
    assert needle in str(err.value)


def test_warnings() -> None:
    ignored = _load({"select_interval": 3})
    assert any('ignored with select_strategy "auto"' in w for w in ignored.warnings)
    no_offload = _load({"topk_ratio": 0.05}, device="none")
    assert any("ZenFlow is a mode of CPU optimizer offload" in w for w in no_offload.warnings)
