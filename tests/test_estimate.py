"""The memory model (Contract 4) against its formula and the ZeRO paper's numbers."""

from __future__ import annotations

import pytest

from zerorun.config import load_config
from zerorun.estimate import (
    GB,
    TERMS,
    BytesPerElement,
    estimate_table,
    model_state_bytes,
    optimizer_state_bytes,
    parse_count,
)

PSI = 7_500_000_000


@pytest.mark.parametrize("stage,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_example(stage, expected_gb):
    # ZeRO paper, figure 1: Ψ = 7.5B, N = 64, K = 12.
    est = model_state_bytes(PSI, 64, stage=stage)
    assert round(est.model_states("gpu") / GB, 1) == expected_gb
    assert est.model_states("cpu") == 0 and est.model_states("nvme") == 0


def _mixed(stage: int, **zero) -> dict:
    return {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": stage, **zero}}


@pytest.mark.parametrize(
    "stage,factors",
    [  # bytes per element (replicated, or /N) of params, grads, master, optimizer_states
        (0, (2, 4, 4, 8, "", "", "", "")),
        (1, (2, 4, 4, 8, "", "", "/N", "/N")),
        (2, (2, 4, 4, 8, "", "/N", "/N", "/N")),
        # the fp32 master slice is the at-rest parameter: no 16-bit slice (16Ψ/N, the paper's total)
        (3, (0, 4, 4, 8, "/N", "/N", "/N", "/N")),
    ],
)
def test_contract4_table_mixed_precision_adam(stage, factors):
    psi, n = 1_000_003, 7  # not divisible: partitioned terms are exactly Ψ/N
    est = model_state_bytes(psi, n, load_config(_mixed(stage)))
    widths, divs = factors[:4], factors[4:]
    for term, width, div in zip(TERMS, widths, divs, strict=True):
        expected = width * psi / (n if div else 1)
        assert est.terms["gpu"][term] == pytest.approx(expected), term
        assert est.formulas[term] == (f"{width}Ψ{div} on gpu" if width else "0 on gpu")
    assert est.model_states("gpu") == pytest.approx(sum(est.terms["gpu"].values()))
    # gradients exist from backward to the step only: between steps the GPU holds the rest
    assert est.between_steps("gpu") == pytest.approx(est.model_states("gpu") - est.terms["gpu"]["grads"])
    assert est.as_dict()["between_steps_per_rank"]["gpu"] == est.between_steps("gpu")


def test_stage3_at_rest_and_after_backward_are_12_and_16_psi_over_n():
    # What tests/runtime/_s3_gpu_memory.py measures with the CUDA allocator.
    psi, n = 64_000, 4
    est = model_state_bytes(psi, n, load_config(_mixed(3)))
    assert est.model_states("gpu") == 16 * psi / n and est.between_steps("gpu") == 12 * psi / n
    assert est.formula("gpu") == "16Ψ/N"
    assert any("at-rest parameter" in note for note in est.notes)
    # fp32 training: the parameter slice is the master (4Ψ/N params, no master)
    fp32 = model_state_bytes(psi, n, load_config({"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 3}}))
    assert fp32.terms["gpu"]["params"] == 4 * psi / n and fp32.terms["gpu"]["master"] == 0
    # the paper's model keeps its 2Ψ/N parameter slice
    assert model_state_bytes(psi, n, stage=3).terms["gpu"]["params"] == 2 * psi / n


def test_communication_dtype_halves_gradients_and_fp32_has_no_master():
    est = model_state_bytes(1000, 4, load_config({**_mixed(2), "communication_data_type": "bf16"}))
    assert est.bytes_per_element.grads == 2 and est.terms["gpu"]["grads"] == 2 * 1000 / 4
    fp32 = model_state_bytes(1000, 4, load_config({"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 3}}))
    assert fp32.bytes_per_element == BytesPerElement(4, 4, 0, 8, precision="fp32", optimizer="Adam")
    assert fp32.terms["gpu"] == {"params": 1000.0, "grads": 1000.0, "master": 0.0, "optimizer_states": 2000.0}
    fp32_s1 = model_state_bytes(1000, 4, load_config({"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 1}}))
    assert fp32_s1.terms["gpu"] == {"params": 4000.0, "grads": 4000.0, "master": 0.0, "optimizer_states": 2000.0}


@pytest.mark.parametrize(
    "name,params,expected",
    [
        ("Adam", {}, 8),
        ("adamw", {"amsgrad": True}, 12),
        ("SGD", {"momentum": 0.9}, 4),
        ("SGD", {}, 0),
        ("Adagrad", {}, 4),
        ("RMSprop", {"momentum": 0.9, "centered": True}, 12),
        ("Lamb", {}, 8),
        (None, None, 8),
    ],
)
def test_optimizer_state_bytes(name, params, expected):
    assert optimizer_state_bytes(name, params)[0] == expected


def test_config_optimizer_changes_the_bytes():
    cfg = load_config({"bf16": {"enabled": True}, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}})
    est = model_state_bytes(100, 1, cfg)
    assert est.bytes_per_element.optimizer_states == 4 and est.bytes_per_element.optimizer == "SGD"
    assert est.model_states("gpu") == (2 + 4 + 4 + 4) * 100


def test_offload_moves_terms_to_the_host():
    psi, n = 8000, 8
    # The CPU optimizer steps from an fp32 host copy of each reduced gradient slice; the GPU
    # keeps its gradients (a slice at stages 2-3, the full buffer at stage 1) until the step.
    s2 = model_state_bytes(psi, n, load_config(_mixed(2, offload_optimizer={"device": "cpu"})))
    assert s2.terms["gpu"] == {"params": 2 * psi, "grads": 4 * psi / n, "master": 0.0, "optimizer_states": 0.0}
    assert s2.terms["cpu"] == {"params": 0.0, "grads": 4 * psi / n, "master": 4 * psi / n, "optimizer_states": 8 * psi / n}
    assert s2.formulas["grads"] == "4Ψ/N on gpu + 4Ψ/N on cpu"
    assert s2.formula("gpu") == "2Ψ + 4Ψ/N" and s2.formula("cpu") == "16Ψ/N"
    assert s2.between_steps("gpu") == 2 * psi and s2.between_steps("cpu") == s2.model_states("cpu")
    s1 = model_state_bytes(psi, n, load_config(_mixed(1, offload_optimizer={"device": "cpu"})))
    assert s1.terms["gpu"]["grads"] == 4 * psi and s1.terms["cpu"]["grads"] == 4 * psi / n
    s3 = model_state_bytes(
        psi, n, load_config(_mixed(3, offload_optimizer={"device": "nvme", "nvme_path": "/x"}, offload_param={"device": "cpu"}))
    )
    assert s3.terms["gpu"] == {"params": 0.0, "grads": 4 * psi / n, "master": 0.0, "optimizer_states": 0.0}
    assert s3.between_steps("gpu") == 0
    assert s3.terms["cpu"]["params"] == 2 * psi / n and s3.terms["cpu"]["grads"] == 4 * psi / n
    assert s3.terms["nvme"]["master"] == 4 * psi / n and s3.terms["nvme"]["optimizer_states"] == 8 * psi / n
    # max(2, buffer_count 4) tile buffers of master + states, a tile no larger than the shard
    assert s3.buffers["cpu"] == {"nvme_optimizer_tiles": 4 * (psi // n) * (4 + 8), "nvme_param_staging": 2 * (psi // n)}
    # parameters offloaded, optimizer on the GPU: the 16-bit slice lives on the host, the master on the GPU
    p3 = model_state_bytes(psi, n, load_config(_mixed(3, offload_param={"device": "cpu"})))
    assert p3.terms["cpu"] == {"params": 2 * psi / n, "grads": 0.0, "master": 0.0, "optimizer_states": 0.0}
    assert p3.model_states("gpu") == 16 * psi / n
    # offload moves terms and adds the host gradient copy (and, at stage 3, the 16-bit slice
    # that no longer doubles as the master); nothing is lost
    for est, added in ((s1, 4), (s2, 4), (s3, 4 + 2), (p3, 2)):
        assert sum(est.model_states(d) for d in ("gpu", "cpu", "nvme")) == pytest.approx(
            model_state_bytes(psi, n, load_config(_mixed(est.stage))).model_states("gpu") + added * psi / n
        )
    # fp32 training keeps no master on the GPU, but the CPU optimizer steps on an fp32 host master
    f1 = model_state_bytes(psi, n, load_config({"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}))
    assert f1.terms["cpu"]["master"] == 4 * psi / n and f1.terms["gpu"]["params"] == 4 * psi


def test_offload_without_effect_is_ignored_with_a_note():
    est = model_state_bytes(100, 2, stage=0, offload_optimizer="cpu")
    assert est.offload_optimizer == "none" and est.model_states("cpu") == 0
    assert any("no effect at stage 0" in n for n in est.notes)
    est = model_state_bytes(100, 2, stage=2, offload_param="cpu")
    assert est.offload_param == "none" and est.terms["gpu"]["params"] == 200


def test_buffers_are_a_separate_capped_term():
    # stages 0-1 reduce and gather in place: no buffers
    assert model_state_bytes(2000, 4, load_config(_mixed(1, reduce_bucket_size=100))).buffers["gpu"] == {}
    # stage 2: up to three staging buckets of reduce_bucket_size (or the largest layer) elements
    cfg = load_config(_mixed(2, reduce_bucket_size=1000))
    est = model_state_bytes(20_000, 4, cfg)
    assert est.buffers["gpu"] == {"reduce_staging": 3 * 1000 * 4.0}
    assert est.total("gpu") == est.model_states("gpu") + 12_000
    assert model_state_bytes(20_000, 4, cfg, largest_layer=8320).buffers["gpu"]["reduce_staging"] == 3 * 8320 * 4.0
    assert model_state_bytes(1000, 4, cfg).buffers["gpu"]["reduce_staging"] == 1000 * 4.0  # one bucket holds it all
    assert model_state_bytes(500, 4, cfg).buffers["gpu"]["reduce_staging"] == 500 * 4.0  # capped at Ψ
    # stage 3: see test_stage3_buffers_follow_the_runtime
    no_layer = model_state_bytes(10**9, 8, load_config(_mixed(3)))
    assert no_layer.buffers["gpu"]["reduce_staging"] == 5 * 10**8 * 4  # reduce_bucket_size stands in for G
    assert any("no parameter group" in note for note in no_layer.notes)
    # stage 2 caps its flat buffers at 5e7 elements whatever reduce_bucket_size says
    assert model_state_bytes(10**9, 8, load_config(_mixed(2))).buffers["gpu"]["reduce_staging"] == 3 * 5 * 10**7 * 4
    # one rank reduces in place: no staging at any stage
    assert "reduce_staging" not in model_state_bytes(20_000, 1, cfg).buffers["gpu"]
    assert "reduce_staging" not in model_state_bytes(10**9, 1, load_config(_mixed(3))).buffers["gpu"]


def _s3(psi: int, n: int, layer: int, zerorun: dict | None = None, **zero) -> dict[str, float]:
    cfg = _mixed(3, **zero)
    if zerorun:
        cfg["zerorun"] = zerorun
    return model_state_bytes(psi, n, load_config(cfg), largest_layer=layer).buffers["gpu"]


def test_stage3_buffers_follow_the_runtime():
    """runtime/stage3 as built (G = the largest group, here 10**6 elements of 10**9):"""
    psi, g = 10**9, 10**6
    # one rank, fp32 master shard as the at-rest parameter: the root group stays gathered for the
    # pass and one group is gathered at a time -- nothing prefetched or kept (nothing to overlap
    # or save; ParamGroup.prefetch_pays, hooks.py's world > 1 keep rule), whatever the keys say;
    # gradients are written straight into the shard: no staging
    big = {"stage3_max_reuse_distance": 10**9, "stage3_prefetch_bucket_size": 10**9}
    assert _s3(psi, 1, g, **big) == {"gathered_params": 2 * g * 2.0, "group_grads": g * 2.0}
    # one rank and the at-rest shard already in the compute dtype (optimizer offloaded, or fp32
    # training): the parameters are bound to the shard for good (ParamGroup.resident)
    off = {"offload_optimizer": {"device": "cpu"}}
    assert _s3(psi, 1, g, **off)["gathered_params"] == 0
    fp32 = model_state_bytes(psi, 1, load_config({"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 3}}), largest_layer=g)
    assert fp32.buffers["gpu"] == {"gathered_params": 0.0, "group_grads": g * 4.0}
    # one rank with parameters on the host: the host->device copy overlaps, so it prefetches
    par = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}, "stage3_prefetch_bucket_size": 10**7}
    assert _s3(psi, 1, g, **par)["gathered_params"] == (2 * g + 10**7 + g) * 2
    # ... each gather in flight reading a device upload of its host shard (the running group's
    # and the prefetched ones', a shard each)
    assert _s3(psi, 1, g, **par)["param_uploads"] == (g + 10**7 + g) * 2
    assert _s3(psi, 8, g, **{**par, "stage3_prefetch_bucket_size": 0})["param_uploads"] == g / 8 * 2
    assert "param_uploads" not in _s3(psi, 8, g)
    # several ranks: one group's reduce-scatter staging (the previous one is retired before the
    # next fills its buffer), the groups kept by the reuse distance (< R/2 elements after them,
    # + the first kept group), prefetch up to the bucket (+ the group crossing it) within the
    # live limit
    s3 = _s3(psi, 8, g, stage3_prefetch_bucket_size=10**7, stage3_max_live_parameters=10**8, stage3_max_reuse_distance=0)
    assert s3 == {"gathered_params": (2 * g + 10**7 + g) * 2.0, "reduce_staging": g * 4.0, "group_grads": g * 2.0}
    kept = _s3(psi, 8, g, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=4 * 10**7)
    assert kept["gathered_params"] == (2 * g + 2 * 10**7 + g) * 2
    live = _s3(psi, 8, g, stage3_prefetch_bucket_size=10**8, stage3_max_live_parameters=5 * 10**6, stage3_max_reuse_distance=0)
    assert live["gathered_params"] == (2 * g + 5 * 10**6) * 2
    # gradient accumulation: later micro-steps add a received shard (N > 1) or the concatenated
    # gradients in the compute dtype (one rank) to the gradient shard
    assert _s3(psi, 8, g, stage3_max_reuse_distance=0)["reduce_staging"] == g * 4
    acc = {"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 3}}
    assert model_state_bytes(psi, 8, load_config({**_mixed(3), **acc}), largest_layer=g).buffers["gpu"][
        "reduce_staging"
    ] == g * 4 * (1 + 1 / 8)
    assert model_state_bytes(psi, 1, load_config({**_mixed(3), **acc}), largest_layer=g).buffers["gpu"][
        "reduce_staging"
    ] == g * 2
    derived = {**_mixed(3), "train_batch_size": 64, "train_micro_batch_size_per_gpu": 2}
    assert "reduce_staging" in model_state_bytes(psi, 1, load_config(derived), largest_layer=g).buffers["gpu"]
    assert model_state_bytes(psi, 32, load_config(derived), largest_layer=g).buffers["gpu"]["reduce_staging"] == g * 4
    # stage3_reshard_after_forward false keeps every group gathered from its forward to its backward
    assert _s3(psi, 8, g, {"stage3_reshard_after_forward": False})["gathered_params"] == psi * 2
    # everything capped at the model
    assert _s3(3 * 10**6, 8, g)["gathered_params"] == 3 * 10**6 * 2
    # communication_data_type bf16: staging in 16 bits
    assert model_state_bytes(psi, 8, load_config({**_mixed(3), "communication_data_type": "bf16"}), largest_layer=g).buffers[
        "gpu"
    ]["reduce_staging"] == g * 2


def test_inputs_and_table():
    # a plain DeepSpeed dict works too (the runtime's tests pass what they trained with)
    assert model_state_bytes(10, 1, {"zero_optimization": {"stage": 1}}).stage == 1
    rows = estimate_table(PSI, 8, 8)
    assert [(s, label) for s, label, _ in rows] == [
        (0, "none"), (1, "none"), (1, "optimizer"), (2, "none"), (2, "optimizer"),
        (3, "none"), (3, "optimizer"), (3, "optimizer+params"),
    ]  # fmt: skip
    # the paper's widths (2-byte gradients on the GPU until the step) + the fp32 host gradient copy
    assert rows[-1][2].model_states("gpu") == pytest.approx(2 * PSI / 64)
    assert rows[-1][2].model_states("cpu") == pytest.approx((2 + 4 + 4 + 8) * PSI / 64)
    assert rows[3][2].formula("gpu") == "2Ψ + 14Ψ/N"
    with pytest.raises(ValueError):
        model_state_bytes(10, 0)


@pytest.mark.parametrize(
    "text,value",
    [("7.5e9", 7_500_000_000), ("7.5B", 7_500_000_000), ("350M", 350_000_000), ("1.3b", 1_300_000_000),
     ("7_000", 7000), ("12k", 12_000), (1e6, 1_000_000)],
)  # fmt: skip
def test_parse_count(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-5", "1e999", "nan"])
def test_parse_count_rejects(text):
    with pytest.raises(ValueError):
        parse_count(text)
