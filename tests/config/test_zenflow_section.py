"""zero_optimization.zenflow: every DeepSpeed ZenFlow key and its "auto" values accepted and
validated like DeepSpeed (ranges, strategy/interval rules); the keys zerorun does not act on
are print-config notices, its own choices for "auto" values are warnings; the settings the
runtime gets (tests/runtime/test_offload_zenflow.py runs them)."""

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
    zero = {"stage": stage, "offload_optimizer": {"device": device}, "zenflow": zenflow}
    return load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero})


def test_every_deepspeed_key_is_accepted_and_noticed() -> None:
    loaded = _load(ALL_KEYS)
    zf = loaded.config.zero_optimization.zenflow
    assert {k: getattr(zf, k) for k in ALL_KEYS} == ALL_KEYS
    assert loaded.warnings == []
    assert sorted(loaded.notices) == sorted(
        f"zero_optimization.zenflow.{k} = {v}: DeepSpeed key accepted; zerorun does not act on it"
        for k, v in (("overlap_step", "true"), ("offload", "true"), ("auto_ratio", 0.95), ("pt_reserved_cores_perc", 0.25))
    )
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
    ignored = _load({"select_interval": 3, "update_interval": 2, "steps_per_epoch": 10})
    assert any('ignored with select_strategy "auto"' in w for w in ignored.warnings)
    no_offload = _load({"topk_ratio": 0.05}, device="none")
    assert any("ZenFlow is a mode of CPU optimizer offload" in w for w in no_offload.warnings)
    autos = _load({})
    assert any('update_interval = "auto"' in w and "zerorun uses 4" in w for w in autos.warnings)
    assert any("selected once" in w for w in autos.warnings)  # epoch strategy, steps per epoch unknown


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "offload_optimizer.ratio < 1"),
        ({"offload_param": {"device": "cpu"}, "stage": 3}, "remove offload_param"),
    ],
)
def test_combinations_that_are_errors(extra: dict, needle: str) -> None:
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"update_interval": 2}, **extra}
    with pytest.raises(ConfigError) as err:
        load_config({"zero_optimization": zero})
    assert needle in str(err.value)
    with pytest.raises(ConfigError, match="delayed_param_update"):
        load_config({"zero_optimization": {**zero, **{k: v for k, v in extra.items() if k == "stage"}, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "none"}}, "zerorun": {"delayed_param_update": True}})


def test_settings_resolve_the_intervals() -> None:
    from zerorun.runtime.settings import settings_from_config

    def zf(section: dict, device: str = "cpu"):  # noqa: ANN202
        return settings_from_config(_load(section, device=device).config, world_size=1).offload.zenflow

    s = zf({"topk_ratio": 0.05, "select_strategy": "step", "select_interval": 8, "update_interval": 4, "full_warm_up_rounds": 3})
    assert (s.topk_ratio, s.select_interval, s.update_interval, s.warmup) == (0.05, 8, 4, 3)
    assert zf({"select_strategy": "epoch", "select_interval": 2, "steps_per_epoch": 50, "update_interval": 4}).select_interval == 100
    assert zf({}).select_interval == 0 and zf({}).update_interval == 4  # once; "auto" -> 4
    assert zf({}, device="none") is None


def test_estimate_counts_the_gpu_buffers() -> None:
    from zerorun.estimate import model_state_bytes

    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"topk_ratio": 0.05}},
    }
    est = model_state_bytes(1_000_000_000, 4, cfg)
    assert est.buffers["gpu"]["zenflow_gradient_sum"] == 4 * 250_000_000
    assert est.buffers["gpu"]["zenflow_important_states"] == pytest.approx(12 * 0.05 * 250_000_000)
    assert any("zenflow" in note for note in est.notes)
    plain = model_state_bytes(1_000_000_000, 4, {**cfg, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert "zenflow_gradient_sum" not in plain.buffers["gpu"]
