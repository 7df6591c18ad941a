"""The benchmark harness on CPU: a real (tiny) run end to end, plus its pure pieces.

One orchestrated launch (plain + zerorun stage 2, one process each, gloo) checks that the
harness runs, writes valid JSON per configuration, and that RESULTS.md renders from it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import configs, memory_model, report  # noqa: E402
from benchmarks.measure import throughput  # noqa: E402
from benchmarks.orchestrate import LaunchOutcome, finish_record, run_launch  # noqa: E402
from benchmarks.results import SCHEMA, import_bundle, load_records, write_record  # noqa: E402
from benchmarks.workload import gpt_model  # noqa: E402


def test_reference_model_is_the_issue_recipe() -> None:
    cfg = gpt_model.get_config("1.3B")
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.vocab_size, cfg.seq_len) == (24, 2048, 16, 32000, 2048)
    with torch.device("meta"):
        model = gpt_model.GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert n == gpt_model.count_parameters(cfg) == 1_343_426_560
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model.head.weight is not model.tok_emb.weight  # untied
    # 72·L·d² + 12·L·s·d + 6·V·d
    assert gpt_model.flops_per_token(cfg) == 72 * 24 * 2048**2 + 12 * 24 * 2048 * 2048 + 6 * 32000 * 2048


def test_synthetic_batches_are_reproducible_per_step_and_rank() -> None:
    cfg = gpt_model.get_config("tiny")
    a = gpt_model.SyntheticTokens(cfg, 3, "cpu", seed=7)
    b = gpt_model.SyntheticTokens(cfg, 3, "cpu", seed=7)
    x5, y5 = a.batch(5)
    b.batch(0)  # what came before does not matter
    assert torch.equal(b.batch(5)[0], x5)
    assert torch.equal(x5[:, 1:], y5[:, :-1])
    assert x5.shape == (3, cfg.seq_len) and int(x5.max()) < cfg.vocab_size
    other_rank = gpt_model.SyntheticTokens(cfg, 3, "cpu", seed=7, rank=1)
    assert not torch.equal(other_rank.batch(5)[0], x5)


def test_select_presets_and_unknown_names() -> None:
    chosen, notes = configs.select("quick,zero3", world_size=1)
    assert [c.name for c in chosen] == ["plain", "fsdp2", "zero2", "zero3"]
    chosen, notes = configs.select("full", world_size=1)
    assert "ddp" not in [c.name for c in chosen] and any("ddp" in n for n in notes)
    assert "ddp" in [c.name for c in configs.select("full", world_size=2)[0]]
    plan = [(c.name, r) for c, r in configs.run_plan(configs.select("full", 2)[0])]
    slow = plan[plan.index(("plain", 2)) + 1 :]  # baseline again before the slow ones
    assert plan[0] == ("plain", 1) and {n for n, _ in slow} == {
        "fsdp2_offload",
        "zero2_offload_opt",
        "zero2_offload_dpu",
        "zero2_offload_ratio",
        "zero3_offload_opt",
        "zero3_offload_ratio",
        "zero3_offload_param",
        "zero2_zenflow",
    }
    zen = configs.zerorun_ds_config(
        configs.CATALOGUE["zero2_zenflow"], micro_batch=8, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0
    )
    assert zen["zero_optimization"]["zenflow"] == configs.ZENFLOW
    half = configs.zerorun_ds_config(
        configs.CATALOGUE["zero2_offload_ratio"], micro_batch=8, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0
    )
    assert half["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "ratio": 0.5}
    dpu = configs.zerorun_ds_config(
        configs.CATALOGUE["zero2_offload_dpu"], micro_batch=8, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0
    )
    assert dpu["zerorun"] == {"delayed_param_update": True}
    assert dpu["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    with pytest.raises(ValueError, match="zero9"):
        configs.select("plain,zero9", world_size=1)
    ds = configs.zerorun_ds_config(
        configs.CATALOGUE["zero3_offload_param"],
        micro_batch=8,
        lr=1e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.01,
        override={"zero_optimization": {"reduce_bucket_size": 123}},
    )
    zero = ds["zero_optimization"]
    assert (
        zero["stage"] == 3 and zero["offload_param"]["device"] == "cpu" and zero["reduce_bucket_size"] == 123
    )
    assert zero["offload_optimizer"]["device"] == "cpu" and ds["bf16"]["enabled"] is True


def test_zero_formulas_follow_contract_4() -> None:
    psi, n = 1000, 4
    assert memory_model.model_state_bytes(psi, n, 0)["gpu"]["total"] == 18 * psi
    assert memory_model.model_state_bytes(psi, n, 1)["gpu"]["total"] == 6 * psi + 12 * psi / n
    assert memory_model.model_state_bytes(psi, n, 2)["gpu"]["total"] == 2 * psi + 16 * psi / n
    assert memory_model.model_state_bytes(psi, n, 2, grad_bytes=2)["gpu"]["total"] == 2 * psi + 14 * psi / n
    # stage 3: the fp32 master slice is the at-rest parameter (no 16-bit slice)
    s3 = memory_model.model_state_bytes(psi, n, 3)["gpu"]
    assert s3["total"] == 16 * psi / n and s3["params"] == 0 and s3["between_steps"] == 12 * psi / n
    # gradients exist from backward to the step: between steps the GPU holds the rest
    assert memory_model.model_state_bytes(psi, n, 2)["gpu"]["between_steps"] == 2 * psi + 12 * psi / n
    # offload: the GPU keeps its gradient slice until the step, the CPU steps from an fp32 copy
    off = memory_model.model_state_bytes(psi, n, 3, offload_optimizer=True, offload_param=True)
    assert off["gpu"]["total"] == 4 * psi / n and off["gpu"]["between_steps"] == 0
    assert off["host"]["total"] == off["host"]["between_steps"] == (2 + 4 + 4 + 8) * psi / n
    s1 = memory_model.model_state_bytes(psi, n, 1, offload_optimizer=True)
    assert s1["gpu"]["total"] == 6 * psi and s1["host"]["grads"] == 4 * psi / n
    # buffers follow zerorun.estimate: stage 2 stages three buckets, stages 0-1 reduce in place
    ds = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "reduce_bucket_size": 100}}
    assert memory_model.config_buffer_bytes(ds, psi, n) == {"reduce_staging": 3 * 100 * 4.0, "total": 1200.0}
    ds["zero_optimization"]["stage"] = 1
    assert memory_model.config_buffer_bytes(ds, psi, n) == {"total": 0}
    with pytest.raises(ValueError):
        memory_model.model_state_bytes(psi, n, 2, offload_param=True)
    summary = {"cuda:0": {"params": 5, "buffers": 4, "module_buffers": 9}, "cpu": {"buffers": 1}}
    assert memory_model.reported_buffer_bytes(summary, "cuda") == 4
    assert memory_model.reported_buffer_bytes(summary, "cpu") == 1
    assert memory_model.reported_buffer_bytes({"buffers": 7}) == 7
    assert memory_model.reported_buffer_bytes({"cuda:0": {"params": 1}}) is None


def test_throughput_and_mfu() -> None:
    t = throughput(
        [0.5, 0.3, 0.4], tokens_per_step=4096, world_size=2, flops_per_token=1e9, peak_flops_per_gpu=1e12
    )
    assert t["step_time_median_s"] == 0.4
    assert t["tokens_per_s"] == pytest.approx(10240) and t["tokens_per_s_per_gpu"] == pytest.approx(5120)
    assert t["mfu"] == pytest.approx(5120 * 1e9 / 1e12)


def _rec(config: str, tps: float, loss: float, mem: int, repeat: int = 1, world: int = 1) -> dict:
    return {
        "schema": SCHEMA,
        "run_id": "r1",
        "config": config,
        "mode": "throughput",
        "repeat": repeat,
        "status": "ok",
        "world_size": world,
        "tokens_per_s_per_gpu": tps,
        "tokens_per_s": tps * world,
        "final_loss": loss,
        "gpu_mem_peak_allocated_bytes": mem,
        "size": "tiny",
    }


def test_report_ratios_noise_band_and_loss_check() -> None:
    recs = [
        _rec("plain", 100.0, 5.0, 50),
        _rec("plain", 110.0, 5.0, 50, repeat=2),
        _rec("fsdp2", 120.0, 5.01, 40),
        _rec("zero2", 115.0, 5.02, 30),
        _rec("zero3", 60.0, 6.0, 20),
        {
            "schema": SCHEMA,
            "run_id": "r1",
            "config": "zero2_offload_opt",
            "status": "timeout",
            "error": "no result within the 60 s deadline; killed",
            "mode": "throughput",
        },
    ]
    mean, band, loss = report.baseline(recs)
    assert mean == 105.0 and band == pytest.approx(10 / 105) and loss == 5.0
    md = report.render(recs)
    assert "| zero2 | ok |" in md and "| 1.10 | 0.96 | 0.75 |" in md  # × plain, × FSDP2, mem ÷ FSDP2
    # 115/120 = 0.958 is inside the 9.5 % band: meets "not below FSDP2"; zero3 (0.5×) does not.
    assert "`zero2`: speed 0.96× FSDP2 ✓" in md and "`zero3`: speed 0.50× FSDP2 ✗" in md
    assert "6.0000 ✗" in md and "5.0200 ✓" in md
    assert "**timeout** — no result within the 60 s deadline" in md
    assert "not yet measured" in md  # no multi-GPU run yet, and the page says so


def test_offload_rows_are_judged_against_their_own_targets() -> None:
    """One table of targets (report.OFFLOAD_TARGETS, issue 17): each offload row against zerorun's
    own no-offload row of its stage, at its own least ratio; a Twin-Flow ratio row also against
    the memory halfway between full offload and none."""
    G = report.GIB
    recs = [
        _rec("fsdp2", 100.0, 5.0, 40 * G),
        _rec("zero2", 100.0, 5.0, 40 * G),
        _rec("zero2_offload_opt", 66.0, 5.0, 20 * G),
        _rec("zero2_offload_dpu", 74.0, 5.1, 20 * G),
        _rec("zero2_offload_ratio", 86.0, 5.0, 31 * G),  # halfway between 20 and 40 GiB is 30: over it
        _rec("zero2_zenflow", 91.0, 5.0, 20 * G),
        _rec("zero3", 200.0, 5.0, 30 * G),
        _rec("zero3_offload_opt", 128.0, 5.0, 10 * G),  # 0.64x: just under its 0.65x
        _rec("zero3_offload_ratio", 170.0, 5.0, 20 * G),  # halfway between 10 and 30 is 20: at it
        _rec("zero3_offload_param", 120.0, 5.0, 5 * G),
    ]
    md = report.render(recs).split("Targets:")[1]
    assert "`zero2_offload_opt`: 0.66× `zero2` ✓ (target ≥ 0.65×" in md
    assert "`zero3_offload_opt`: 0.64× `zero3` ✗ (target ≥ 0.65×" in md
    assert "`zero2_offload_dpu`: 0.74× `zero2` ✗ (target ≥ 0.75×" in md
    assert "`zero2_zenflow`: 0.91× `zero2` ✓ (target ≥ 0.90×" in md
    assert "`zero3_offload_param`: 0.60× `zero3` ✓ (target ≥ 0.60×" in md
    assert "`zero2_offload_ratio`: 0.86× `zero2` ✓ (target ≥ 0.85×" in md
    assert "peak GPU memory 31.0 GiB > halfway 30.0 GiB between `zero2_offload_opt` and `zero2` ✗" in md
    assert "`zero3_offload_ratio`: 0.85× `zero3` ✓" in md
    assert "peak GPU memory 20.0 GiB ≤ halfway 20.0 GiB between `zero3_offload_opt` and `zero3` ✓" in md
    # The ratio named is the one the row ran with (its own config), not the catalogue's today.
    ran = {**{r["config"]: r for r in recs}}
    ran["zero3_offload_ratio"] = {
        **ran["zero3_offload_ratio"],
        "zerorun_config": {"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.55}}},
    }
    assert any("Twin-Flow ratio 0.55, exact" in x for x in report.offload_target_lines(ran))
    assert "Twin-Flow ratio ?, exact" in md  # a record without its config says it does not know
    # A miss that two decimals would round up to the target shows three.
    near = {**{r["config"]: r for r in recs}, "zero2_zenflow": _rec("zero2_zenflow", 89.6, 5.0, 20 * G)}
    assert any(x.startswith("- `zero2_zenflow`: 0.896× `zero2` ✗") for x in report.offload_target_lines(near))
    # Without the full-offload row there is no halfway to judge: speed only.
    alone = report.offload_target_lines({r["config"]: r for r in recs if r["config"] != "zero2_offload_opt"})
    assert any(x.startswith("- `zero2_offload_ratio`: 0.86×") and "halfway" not in x for x in alone)
    # Every target row is in the catalogue and compared with a no-offload row of its own stage.
    for name, t in report.OFFLOAD_TARGETS.items():
        row, ref = configs.CATALOGUE[name], configs.CATALOGUE[t.ref]
        assert row.stage == ref.stage and row.offloads and not ref.offloads


def test_bundle_round_trip_skips_torn_line(tmp_path: Path) -> None:
    bundle = tmp_path / "b.jsonl"
    write_record(tmp_path / "a", _rec("plain", 1.0, 1.0, 1), bundle)
    write_record(tmp_path / "a", _rec("zero1", 1.0, 1.0, 1), bundle)
    with open(bundle, "a") as f:
        f.write('{"schema": "zerorun-bench/1", "run_id": "r1", "conf')  # killed mid-write
    written = import_bundle(bundle, tmp_path / "b")
    assert sorted(p.name for p in written) == ["r1__plain.json", "r1__zero1.json"]
    assert len(load_records([tmp_path / "b"])) == 2


def test_hung_configuration_is_killed_and_recorded(tmp_path: Path) -> None:
    out = run_launch(
        [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
        {},
        timeout_s=1.5,
        prefix="[hang]",
        echo=False,
    )
    assert out.timed_out and out.wall_s < 15 and "started" in out.tail
    rec = finish_record(tmp_path / "missing.json", out, {"config": "zero3", "run_id": "r"}, 1.5)
    assert rec["status"] == "timeout" and rec["output_tail"] == ["started"]
    crashed = finish_record(tmp_path / "missing.json", LaunchOutcome(-9, False, 1.0, []), {"config": "x"}, 9)
    assert crashed["status"] == "crashed" and "SIGKILL" in crashed["error"]


def test_tiny_run_end_to_end(tmp_path: Path) -> None:
    """Real processes: plain (1 process), DDP and zerorun stage 2 (2 ranks each, torchrun + gloo)
    on the tiny model, then RESULTS.md from what they wrote."""
    out, bundle = tmp_path / "results", tmp_path / "bundle.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "train_bench.py"),
        "--size",
        "tiny",
        "--device",
        "cpu",
        "--configs",
        "plain,ddp,zero2",
        "--nproc",
        "2",
        "--no-baseline-repeat",
        "--warmup",
        "2",
        "--steps",
        "10",
        "--out",
        str(out),
        "--bundle",
        str(bundle),
        "--timeout-s",
        "120",
        "--quiet",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = sorted(out.glob("*.json"))
    assert [f.name.split("__")[1] for f in files] == ["ddp.json", "plain.json", "zero2.json"]
    recs = {r["config"]: r for r in (json.loads(f.read_text()) for f in files)}
    plain, ddp = recs["plain"], recs["ddp"]
    assert plain["status"] == "ok" and plain["schema"] == SCHEMA, plain
    assert len(plain["step_times_s"]) == 10 and plain["step_time_median_s"] > 0
    assert plain["tokens_per_s"] == pytest.approx(4 * 64 / plain["step_time_median_s"])
    assert plain["world_size"] == 1 and plain["torch_version"] == torch.__version__
    assert plain["losses"][-1] < plain["losses"][0]  # the synthetic data is learnable
    assert plain["host_rss_peak_bytes"] > 0 and plain["gpu_mem_peak_allocated_bytes"] is None  # CPU
    assert ddp["status"] == "ok" and ddp["world_size"] == 2 and len(ddp["per_rank_host_rss_peak_bytes"]) == 2
    assert ddp["tokens_per_s"] == pytest.approx(2 * 4 * 64 / ddp["step_time_median_s"])
    zr = recs["zero2"]
    assert zr["status"] in {"ok", "error", "unavailable"}, zr
    if zr["status"] == "ok":  # same weights, same data (2 ranks), bf16 both: the same learning
        assert zr["world_size"] == 2 and zr["engine_memory"]
        assert zr["final_loss"] == pytest.approx(ddp["final_loss"], rel=0.01)
    else:
        assert zr["error"]
    assert len(bundle.read_text().splitlines()) == 3
    md = tmp_path / "RESULTS.md"
    assert report.main(["--results", str(out), "--out", str(md)]) == 0
    text = md.read_text()
    assert "| plain | ok |" in text and "| ddp | ok |" in text and "zero2" in text
    assert "world 2: ddp" in text  # DDP is the loss reference for the 2-rank rows
    assert "x plain" in proc.stdout  # the console table at the end


def test_memory_band_check() -> None:
    inside = memory_model.band_check([100.0, 118.0], formula=100.0, buffers=20.0)
    assert inside["within"] and inside["max_abs_deviation"] == 0.0
    above = memory_model.band_check([100.0, 130.0], formula=100.0, buffers=20.0)
    assert not above["within"] and above["max_abs_deviation"] == pytest.approx(10 / 120)
    below = memory_model.band_check([96.0], formula=100.0, buffers=0.0)
    assert below["within"] and below["deviation_from_band_per_rank"] == [pytest.approx(-0.04)]


def test_report_labels_a_config_override() -> None:
    """A run with --zerorun-override is an experiment: its rows say so (the record keeps the
    override in its launch argv)."""
    rec = {"config": "zero2_offload_opt", "launch_argv": ["x", "--zerorun-override", '{"zerorun": {"a": 1}}']}
    assert report._label(rec) == 'zero2_offload_opt + `{"zerorun": {"a": 1}}`'
    assert report._label({"config": "zero2", "launch_argv": ["x", "--size", "1.3B"]}) == "zero2"
    assert report._label({"config": "zero2", "repeat": 2}) == "zero2 (run 2)"
