"""Twin-Flow partial offload (offload_optimizer.ratio) in one process: the config rules (range,
device, delayed update, "auto" and its budget, the zerorun-extension warning, print-config),
the split rule (twinflow.device_buffers), the settings and the estimate. The runtime's exact
equivalence with plain PyTorch is in test_offload.py (the ratio cases of _offload_cases)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerorun.config import load_config
from zerorun.errors import ConfigError
from zerorun.estimate import model_state_bytes, offload_budget_numel
from zerorun.runtime.offload.options import options_from_settings
from zerorun.runtime.offload.twinflow import device_buffers, ready_order
from zerorun.runtime.settings import settings_from_config


def _cfg(ratio: object, *, device: str = "cpu", stage: int = 2, **zr: object) -> dict:
    off: dict = {"device": device, "ratio": ratio}
    if device == "nvme":
        off["nvme_path"] = "/tmp"
    return {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage, "offload_optimizer": off},
        "zerorun": dict(zr),
    }


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        (_cfg(1.5), "1.5 is not a fraction"),
        (_cfg(-0.1), "is not a fraction"),
        (_cfg("half"), 'expected a number or "auto"'),
        (_cfg(0.5, device="nvme"), "works with offload_optimizer.device 'cpu', not 'nvme'"),
        (_cfg(0.5, delayed_param_update=True), "not built for a partial offload"),
        (_cfg("auto"), '"auto" needs zerorun.offload_gpu_budget_gb'),
        (_cfg("auto", offload_gpu_budget_gb=-1), "offload_gpu_budget_gb"),
    ],
)
def test_ratio_config_errors(cfg: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert needle in str(err.value)


def test_ratio_config_warnings_and_autos() -> None:
    auto = load_config(_cfg("auto", offload_gpu_budget_gb=2))
    assert any('"auto" is a zerorun extension' in w for w in auto.warnings), auto.warnings
    assert auto.open_autos == []  # zerorun resolves it: not an "auto" left for the script
    assert not auto.notices  # acted on: no "accepted but not acted on" notice
    plain = load_config(_cfg(0.3))
    assert plain.warnings == [] and plain.notices == []
    no_dev = load_config(_cfg(0.3, device="none"))
    assert any("no effect without offload_optimizer.device 'cpu'" in w for w in no_dev.warnings)
    stray = load_config(_cfg(1.0, offload_gpu_budget_gb=3))
    assert any("no effect unless offload_optimizer.ratio" in w for w in stray.warnings)


def test_print_config_flags_the_extension(tmp_path, capsys) -> None:  # noqa: ANN001
    from zerorun.cli import config_cmds

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_cfg("auto", offload_gpu_budget_gb=2)))
    try:
        config_cmds.app([str(path), "--world-size", "2", "--params", "1e9"], prog_name="zerorun")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    assert code == 0, out + err
    text = " ".join(out.split())
    assert '"auto" is a zerorun extension' in text
    assert "partial offload (Twin-Flow)" in text  # the estimate says what sits where


@pytest.mark.parametrize(
    ("numels", "ratio", "budget", "expected"),
    [
        ([10, 10, 10, 10], 0.5, 0, [False, False, True, True]),  # the last buffers stay on the device
        ([10, 10, 10, 10], 0.6, 0, [False, False, False, True]),  # host share never below the ratio
        ([10, 10, 10, 10], 1.0, 0, [False] * 4),
        ([10, 10, 10, 10], 0.0, 0, [True] * 4),
        ([30, 5, 20], 0.5, 0, [False, True, True]),  # 25 of 55 on the device
        ([10, 40, 10], 0.5, 0, [True, False, True]),  # a buffer too big is skipped, earlier ones still fit
        ([100], 0.5, 0, [False]),  # one flat buffer: all or nothing
        ([10, 10, 10], None, 25, [False, True, True]),  # "auto": at most the budget's elements
        ([10, 10, 10], None, 0, [False] * 3),
        ([0, 10], 0.0, 0, [False, True]),  # empty shards stay on the host (nothing to place)
    ],
)
def test_device_buffers(numels: list[int], ratio: float | None, budget: int, expected: list[bool]) -> None:
    got = device_buffers(numels, ratio, budget)
    assert got == expected
    on_dev = sum(n for n, d in zip(numels, got, strict=True) if d)
    if ratio is not None:
        assert on_dev <= (1 - ratio) * sum(numels) + 1e-9
    else:
        assert on_dev <= budget


def test_device_buffers_follow_the_ready_order() -> None:
    """The device takes the buffers whose gradients are final last: stages 1-2 the last flat
    buffers, stage 3 the first (module groups in forward order, the root group first)."""
    assert ready_order(4, 2) == [0, 1, 2, 3] and ready_order(4, 1) == [0, 1, 2, 3]
    assert ready_order(4, 3) == [3, 2, 1, 0]
    numels = [30, 10, 10, 10]
    assert device_buffers(numels, 0.5, 0, ready_order(4, 2)) == [False, True, True, True]
    assert device_buffers(numels, 0.5, 0, ready_order(4, 3)) == [True, False, False, False]  # 30 of 60
    assert device_buffers(numels, 0.6, 0, ready_order(4, 3)) == [False, True, True, False]  # 30 > 24: skipped
    assert device_buffers([10, 10, 10], None, 15, [2, 0, 1]) == [False, True, False]
    with pytest.raises(ValueError, match="not a permutation"):
        device_buffers([10, 10], 0.5, 0, [0, 0])


def test_settings_carry_ratio_and_budget() -> None:
    o = options_from_settings(settings_from_config(load_config(_cfg(0.25)).config, world_size=1))
    assert o.ratio == 0.25
    o = options_from_settings(settings_from_config(load_config(_cfg("auto", offload_gpu_budget_gb=1.2)).config, world_size=1))
    assert o.ratio is None
    # bf16 + AdamW: 4 (fp32 master) + 8 (m, v) bytes per element on the device
    assert o.device_budget_numel == int(1.2e9 // 12) == offload_budget_numel(load_config(_cfg("auto", offload_gpu_budget_gb=1.2)))
    fp32 = dict(_cfg("auto", offload_gpu_budget_gb=1.2), bf16={"enabled": False})
    assert offload_budget_numel(load_config(fp32)) == int(1.2e9 // 8)  # the parameter shard is the master


def test_estimate_splits_master_and_states() -> None:
    psi, n = 1_000_000_000, 2
    full = model_state_bytes(psi, n, _cfg(1.0))
    part = model_state_bytes(psi, n, _cfg(0.25))
    assert part.offload_ratio == 0.25 and full.offload_ratio == 1.0
    shard = psi / n
    assert part.terms["cpu"]["master"] == pytest.approx(4 * 0.25 * shard)
    assert part.terms["gpu"]["master"] == pytest.approx(4 * 0.75 * shard)
    assert part.terms["cpu"]["optimizer_states"] == pytest.approx(8 * 0.25 * shard)
    assert part.terms["gpu"]["optimizer_states"] == pytest.approx(8 * 0.75 * shard)
    assert part.terms["cpu"]["grads"] == pytest.approx(4 * 0.25 * shard)  # host copy of the host part only
    assert part.terms["gpu"]["grads"] == full.terms["gpu"]["grads"]
    # every element's master and states exist exactly once
    for term in ("master", "optimizer_states"):
        assert part.terms["gpu"][term] + part.terms["cpu"][term] == pytest.approx(full.terms["cpu"][term])
    assert part.formula("gpu") == "2Ψ + 13Ψ/N"  # 4 grads + 0.75 × (4 + 8) and part.formula("cpu") == "4Ψ/N"
    auto = model_state_bytes(psi, n, _cfg("auto", offload_gpu_budget_gb=1.2))
    assert auto.offload_ratio == pytest.approx(0.8)  # 1e8 of 5e8 shard elements fit 1.2 GB
    assert auto.terms["gpu"]["master"] + auto.terms["gpu"]["optimizer_states"] == pytest.approx(1.2e9)
    big = model_state_bytes(psi, n, _cfg("auto", offload_gpu_budget_gb=1000))
    assert big.offload_ratio == 0.0 and big.terms["cpu"]["master"] == 0


# The issue-17 rows on one H200 (1.34B GPT: 24 blocks, d_model 2048, vocab 32000, sequence 2048;
# benchmarks/results/<run>__<config>.json), runs with both the full and the partial offload row.
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
# Before b59d23b every stage-3 group kept a 16-bit at-rest shard (Twin-Flow's GPU groups too).
OLD_LAYOUT = {2: "20261201T171821Z-1.3B-w1-thr", 3: "20261201T182912Z-1.3B-w1-thr"}
# After it (a972509): the stage-3 GPU groups' fp32 master is their at-rest parameter.
H200_RUNS = {2: "20261201T171821Z-1.3B-w1-thr", 3: "20261201T202221Z-1.3B-w1-thr"}


def _record(stage: int, config: str, runs: dict[int, str] = H200_RUNS) -> dict:
    return json.loads((RESULTS / f"{runs[stage]}__{config}.json").read_text())


def _stage3_groups() -> list[int]:
    """The 1.34B GPT's stage-3 flat buffers at one rank as runtime/stage3 plans them (padded
    elements, in its order: the root group, the blocks, the persistent group last)."""
    import sys

    import torch

    from zerorun.config.zero_section import ZeroOptimization
    from zerorun.runtime.flat_params import SLOT_ALIGN_BYTES, collect_trainable
    from zerorun.runtime.partition import ParamSpec, plan_flat_buffers
    from zerorun.runtime.stage3.groups import plan_groups

    sys.path.insert(0, str(RESULTS.parents[1] / "examples"))
    import gpt_model

    with torch.device("meta"):
        model = gpt_model.GPT(gpt_model.get_config("1.3B"))
    trainable, _ = collect_trainable(model, None)
    threshold = int(ZeroOptimization.model_fields["stage3_param_persistence_threshold"].default)
    plans = plan_groups(model, trainable, persistence_threshold=threshold, class_names=None, min_numel=0)
    assert plans[-1].persistent and not any(p.persistent for p in plans[:-1])
    out = []
    for plan in plans:
        specs = [ParamSpec(t.name, tuple(t.param.shape), "bfloat16", 0, ()) for t in plan.params]
        (layout,) = plan_flat_buffers(specs, num_shards=1, bucket_numel=1 << 62, slot_align_bytes=SLOT_ALIGN_BYTES)
        out.append(layout.padded_numel)
    return out


def _stage3_peak(full: int, groups: list[int], on_device: list[bool]) -> int:
    """Stage 3's Twin-Flow peak at one rank since b59d23b: the full-offload peak + 12 B per GPU
    element (fp32 master + Adam) - 2 B per GPU element of a partitioned group (no 16-bit at-rest
    shard: the fp32 master is it; the persistent group keeps its 16-bit replicas) + the root
    group gathered in 16 bits when it is a GPU group (it is then no longer resident)."""
    dev = sum(n for n, d in zip(groups, on_device, strict=True) if d)
    partitioned = sum(n for n, d in zip(groups[:-1], on_device[:-1], strict=True) if d)
    return full + 12 * dev - 2 * partitioned + (2 * groups[0] if on_device[0] else 0)


@pytest.mark.parametrize("stage", [2, 3])
def test_h200_peak_is_full_offload_plus_the_device_part(stage: int) -> None:
    """The peak GPU memory of a Twin-Flow row is the full-offload row's plus the device part's
    masters and states (12 B per element, bf16 + AdamW) -- to the byte: nothing else of the split
    adds to the peak, so the device share alone decides the halfway check (the layout where
    every group keeps a 16-bit at-rest shard: stage 2, and stage 3 before b59d23b)."""
    full = _record(stage, f"zero{stage}_offload_opt", OLD_LAYOUT)
    part = _record(stage, f"zero{stage}_offload_ratio", OLD_LAYOUT)
    dev = part["engine_memory"]["cuda:0"]
    added = part["gpu_mem_peak_allocated_bytes"] - full["gpu_mem_peak_allocated_bytes"]
    assert added == dev["master"] + dev["optimizer_states"] and dev["master"] > 0
    # ... and the split never gave the device more than (1 - ratio) of the shard elements
    numel = part["n_params"]
    assert dev["master"] / 4 <= (1 - 0.5) * numel


def test_h200_stage3_gpu_groups_keep_no_16bit_shard() -> None:
    """Stage 3 since b59d23b (ratio 0.55, a972509): the row's peak is _stage3_peak to the byte --
    its GPU groups keep no 16-bit at-rest shard and the root group is gathered -- and the ledger's
    16-bit at-rest shards are the host groups' (+ the persistent replicas)."""
    groups = _stage3_groups()
    full = _record(3, "zero3_offload_opt")
    part = _record(3, "zero3_offload_ratio")
    ratio = part["zerorun_config"]["zero_optimization"]["offload_optimizer"]["ratio"]
    split = device_buffers(groups, ratio, 0, ready_order(len(groups), 3))
    dev = part["engine_memory"]["cuda:0"]
    assert dev["master"] == 4 * sum(n for n, d in zip(groups, split, strict=True) if d)  # the runtime's split
    host = sum(n for n, d in zip(groups[:-1], split[:-1], strict=True) if not d)
    assert dev["params"] == 2 * (host + groups[-1])
    assert part["gpu_mem_peak_allocated_bytes"] == _stage3_peak(full["gpu_mem_peak_allocated_bytes"], groups, split)


def test_h200_ratio_rows_keep_the_peak_within_halfway() -> None:
    """benchmarks/configs.py's ratio rows: the whole-buffer split of the 1.34B model at the
    row's ratio, added to the committed full-offload peak by the rules above (measured to the
    byte), stays at most halfway between the full-offload and the no-offload peaks of the same
    run. Stage 2: + 12 B per GPU element. Stage 3: _stage3_peak; with every element on the GPU it
    gives the committed no-offload peak within 13 KB. With the old stage-3 layout (12 B per GPU
    element) stage 3 needed 0.58."""
    import torch

    from benchmarks.configs import CATALOGUE
    from zerorun.runtime.flat_params import SLOT_ALIGN_BYTES, collect_trainable
    from zerorun.runtime.flat_stage import MAX_FLAT_NUMEL
    from zerorun.runtime.partition import ParamSpec, plan_flat_buffers

    groups = _stage3_groups()
    import gpt_model  # (on sys.path: _stage3_groups)

    with torch.device("meta"):
        model = gpt_model.GPT(gpt_model.get_config("1.3B"))
    trainable, _ = collect_trainable(model, None)
    for stage in (2, 3):
        cfg = CATALOGUE[f"zero{stage}_offload_ratio"]
        assert cfg.offload_optimizer and cfg.stage == stage and 0 < cfg.offload_ratio < 1
        full = _record(stage, f"zero{stage}_offload_opt")["gpu_mem_peak_allocated_bytes"]
        none = _record(stage, f"zero{stage}")["gpu_mem_peak_allocated_bytes"]
        if stage == 3:  # one flat buffer per module group: the root (embeddings, head, final norm), then each block
            numels = groups
        else:  # the runtime's packing: gradient order, at most MAX_FLAT_NUMEL (< DeepSpeed's 5e8 buckets)
            specs = [ParamSpec(t.name, tuple(t.param.shape), "bfloat16", 0, ()) for t in trainable]
            layouts = plan_flat_buffers(specs, num_shards=1, bucket_numel=MAX_FLAT_NUMEL, slot_align_bytes=SLOT_ALIGN_BYTES)
            numels = [layout.padded_numel for layout in layouts]
        split = device_buffers(numels, cfg.offload_ratio, 0, ready_order(len(numels), stage))
        on_device = sum(n for n, d in zip(numels, split, strict=True) if d)
        if stage == 3:
            every = _stage3_peak(full, groups, [True] * len(groups))  # the rule with every element on the GPU
            assert abs(every - none) < 2**20, (every, none)  # 13 KB apart
            peak = _stage3_peak(full, groups, split)
        else:
            peak = full + 12 * on_device
        assert peak <= (full + none) / 2, (stage, cfg.offload_ratio, on_device, peak)
        row = _record(stage, f"zero{stage}_offload_ratio")
        if row["zerorun_config"]["zero_optimization"]["offload_optimizer"]["ratio"] == cfg.offload_ratio:
            # the committed row at this ratio: the same split, and its peak within the rule's
            assert 4 * on_device == row["engine_memory"]["cuda:0"]["master"]
            assert row["gpu_mem_peak_allocated_bytes"] <= peak
