"""Engine checkpoints with real ranks on gloo: save at world 2 stage 2, resume at other world
sizes and stages, a rank killed mid-save, consolidation against the model's state_dict().

One training job (the uninterrupted reference) is shared by every test in this module; the
others are one launch each (a launch costs seconds on the 2-core CI machine)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zerorun.runtime.checkpoint.consolidate import consolidate
from zerorun.runtime.checkpoint.store import CheckpointReader

from ._spawn import spawn

WORKER = str(Path(__file__).with_name("_ckpt_worker.py"))
# fp32 training: the stage tests' tolerance (relative 1e-5, small absolute term)
RTOL, ATOL = 1e-5, 1e-6


def _run(tmp: Path, world: int, spec: dict, *, env: dict[str, str] | None = None, name: str) -> tuple[list, dict]:
    logs = tmp / f"logs-{name}"
    logs.mkdir()
    spec = dict(spec, world=world, out=str(tmp / f"{name}.json"))
    results = spawn(world, [WORKER, json.dumps(spec)], timeout=150, env=env, log_dir=logs)
    out = json.loads((tmp / f"{name}.json").read_text()) if (tmp / f"{name}.json").exists() else {}
    return results, out


def _ok(results: list) -> None:
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited {r.returncode}:\n{r.output[-4000:]}"


def _assert_losses_match(got: dict, want: dict, steps: range) -> None:
    for s in steps:
        assert got[str(s)] == pytest.approx(want[str(s)], rel=RTOL, abs=ATOL), (s, got, want)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """World 2, stage 2: 6 uninterrupted steps, a checkpoint after step 3 (+ the model's
    state_dict and save_16bit_model at that point)."""
    tmp = tmp_path_factory.mktemp("ref")
    spec = {
        "stage": 2, "ckpt": str(tmp / "ckpt"), "steps_to": 6, "save_at": [3],
        "reference": str(tmp / "state_dict.pt"), "save16": str(tmp / "m16"),
        "state_dict_at": {"5": str(tmp / "state_dict5.pt")},
    }
    results, out = _run(tmp, 2, spec, name="ref")
    _ok(results)
    assert out["save16"] is True
    return {"tmp": tmp, "ckpt": tmp / "ckpt", "losses": out["losses"], "state_dict": tmp / "state_dict.pt", "out": out,
            "state_dict5": tmp / "state_dict5.pt"}


def test_layout_is_deepspeeds(reference):
    ckpt = reference["ckpt"]
    assert (ckpt / "latest").read_text() == "global_step3"
    names = sorted(p.name for p in (ckpt / "global_step3").iterdir())
    assert names == [
        "engine_state.pt", "rng_rank00000.pt", "rng_rank00001.pt",
        "shard_rank00000.safetensors", "shard_rank00001.safetensors", "zerorun_checkpoint.json",
    ]
    with CheckpointReader(ckpt / "global_step3") as rd:
        assert rd.meta.stage == 2 and rd.meta.world_size == 2
        assert rd.meta.tied == {"head.weight": "emb.weight"}
        assert rd.meta.counters["global_steps"] == 3
        assert rd.kinds() == {"weight", "buffer", "optim.exp_avg", "optim.exp_avg_sq"}
        assert rd.meta.optimizer["class"] == "AdamW"
        assert rd.meta.optimizer["scalar_state"][0]["step"] == 3


def test_resume_world1_stage0_matches_uninterrupted(reference, tmp_path):
    spec = {
        "stage": 0, "ckpt": str(reference["ckpt"]), "load": "", "steps_to": 6,
        # then, after step 6: DeepSpeed's partial loads
        "save16_final": [str(tmp_path), "pytorch_model.bin"],
        "extra_saves": [
            {"dir": str(tmp_path / "nofrozen"), "kwargs": {"exclude_frozen_parameters": True}},
            {"dir": str(tmp_path / "a_file" / "ckpt"), "kwargs": {}},  # cannot be created
        ],
        "extra_loads": [
            # the tag directory itself, as users often pass it
            {"dir": str(reference["ckpt"] / "global_step3"), "tag": None, "flags": {"load_module_only": True}},
            {"tag": "global_step3", "flags": {"load_optimizer_states": False}},
            {"tag": "global_step3", "flags": {}},
            {"dir": str(tmp_path / "nofrozen"), "tag": None, "flags": {}},
            {"dir": str(tmp_path / "nofrozen"), "tag": None, "flags": {"load_module_strict": False}},
        ],
    }
    (tmp_path / "a_file").write_text("not a directory")
    results, out = _run(tmp_path, 1, spec, name="w1")
    _ok(results)
    assert "cannot create" in out["extra_save1"] and "Not a directory" in out["extra_save1"]
    # save_16bit_model in torch format: every state_dict key (tied ones share storage), so a
    # strict load_state_dict works, as with DeepSpeed's pytorch_model.bin
    sd16 = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    ref = torch.load(tmp_path / "reference.pt", weights_only=True)
    assert out["save16_final"] is True and set(sd16) == set(ref)
    assert sd16["head.weight"].data_ptr() == sd16["emb.weight"].data_ptr()
    for k in ref:
        assert torch.equal(sd16[k], ref[k]), k
    assert out["loaded"].endswith("global_step3") and out["steps_after_load"] == 3
    assert out["client_state"] == {"step": 3, "note": "resume me"}
    assert out["samples_after_load"] == 24
    assert out["lr_after_load"] == pytest.approx(reference["out"]["lr_at3"])
    _assert_losses_match(out["losses"], reference["losses"], range(4, 7))
    module_only, no_optim, full = out["extra0"], out["extra1"], out["extra2"]
    # module only: weights back to step 3, counters / optimizer / scheduler untouched
    assert module_only["steps"] == 6 and not module_only["exp_avg_changed"]
    assert module_only["params"] == full["params"]
    assert module_only["lr"] != pytest.approx(reference["out"]["lr_at3"])
    # without optimizer states: counters and scheduler restored, optimizer state untouched
    assert no_optim["steps"] == 3 and not no_optim["exp_avg_changed"]
    assert no_optim["lr"] == pytest.approx(reference["out"]["lr_at3"])
    assert full["steps"] == 3 and full["exp_avg_changed"]
    # saved without frozen parameters: a strict load says what is missing and how to proceed
    assert "lacks: ['frozen.weight', 'frozen.bias']" in out["extra3"]["error"]
    assert "load_module_strict=False" in out["extra3"]["error"]
    assert out["extra4"]["steps"] == 6
    with CheckpointReader(tmp_path / "nofrozen" / "global_step6") as rd:
        assert "frozen.weight" not in rd.params and "l1.weight" in rd.params


def test_rank_killed_mid_save_then_resume_at_world4_stage3(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference["ckpt"], ckpt)
    # rank 1 SIGKILLs itself with half of its shard written, while saving global_step4
    spec = {"stage": 2, "ckpt": str(ckpt), "load": "", "steps_to": 4, "save_at": [4]}
    results, out = _run(tmp_path, 2, spec, env={"ZERORUN_CHECKPOINT_CRASH": "1:mid_shard"}, name="crash")
    assert results[1].returncode == -9, results[1].output[-3000:]
    assert results[0].returncode == 3, results[0].output[-3000:]
    assert "previous checkpoint" in out["save_error"]
    # same world size: each rank's RNG continues exactly where it was saved
    assert out["rng_after_load"] == reference["out"]["rng_after_save3"]
    assert (ckpt / "latest").read_text() == "global_step3"
    assert not (ckpt / "global_step4").exists()
    assert (ckpt / ".tmp-global_step4").is_dir()  # left for the next save to clean
    # what `latest` names still loads, at another world size and stage, and training continues
    # exactly as the uninterrupted run
    spec = {"stage": 3, "ckpt": str(ckpt), "load": "", "steps_to": 6, "save_at": [5], "save16": str(tmp_path / "m16")}
    results, out = _run(tmp_path, 4, spec, name="w4")
    _ok(results)
    assert out["loaded"] == str(ckpt / "global_step3")
    assert "ignoring .tmp-global_step4" in results[0].output
    assert "ranks >= 2 get fresh RNG seeds" in results[2].output
    _assert_losses_match(out["losses"], reference["losses"], range(4, 7))
    # the next save cleaned the leftover and moved `latest`
    assert "removed" in results[0].output and not (ckpt / ".tmp-global_step4").exists()
    assert (ckpt / "latest").read_text() == "global_step5"
    with CheckpointReader(ckpt / "global_step5") as rd:
        assert (rd.meta.world_size, rd.meta.stage) == (4, 3)
    # a stage-3 checkpoint consolidates to the uninterrupted run's weights at that step (fp32;
    # world 4 sums gradients in another order than world 2: last-bit differences)
    ref5 = torch.load(reference["state_dict5"], weights_only=True)
    consolidate(ckpt, tmp_path / "hf", dtype="fp32")
    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    sd16 = load_file(str(tmp_path / "m16" / "model.safetensors"))  # stage 3 gathered on save
    assert out["save16"] is True and set(sd) == set(sd16) == set(ref5) - {"head.weight"}
    for k in sd:
        torch.testing.assert_close(sd[k], ref5[k], rtol=RTOL, atol=ATOL)
        assert torch.equal(sd16[k], sd[k]), k


def test_crash_before_latest_keeps_latest_on_previous(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference["ckpt"], ckpt)
    spec = {"stage": 0, "ckpt": str(ckpt), "load": "global_step3", "steps_to": 5, "save_at": [4, 5]}
    results, _ = _run(tmp_path, 1, spec, env={"ZERORUN_CHECKPOINT_CRASH": "0:before_latest"}, name="late")
    assert results[0].returncode == -9
    # the new tag is complete and loadable by name; `latest` was not moved to it
    assert (ckpt / "latest").read_text() == "global_step3"
    with CheckpointReader(ckpt / "global_step4") as rd:
        assert rd.meta.counters["global_steps"] == 4 and rd.meta.world_size == 1


def test_consolidated_equals_reference_state_dict(reference, tmp_path):
    ref = torch.load(reference["state_dict"], weights_only=True)
    res = consolidate(reference["ckpt"], tmp_path / "hf", dtype="fp32")
    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(ref) - set(sd) == {"head.weight"} and res.tied == {"head.weight": "emb.weight"}
    for k, v in sd.items():
        assert v.dtype == ref[k].dtype and torch.equal(v, ref[k]), k
    # save_16bit_model at the same step (fp32 training: the same values)
    sd16 = load_file(str(reference["tmp"] / "m16" / "model.safetensors"))
    assert set(sd16) == set(sd)
    for k, v in sd16.items():
        assert torch.equal(v, ref[k]), k


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_fp16_loss_scaler_state_survives_resume_at_another_stage(tmp_path):
    """fp16 with a scale that overflows, then grows back every 2 steps: after step 5 the scaler
    has used one unit of hysteresis, so the resumed run must halve at its first overflow,
    exactly as the uninterrupted one. Same world size: fp16 overflow depends on each rank's
    local gradient, so only then is the skip pattern itself reshard-invariant."""
    ckpt = str(tmp_path / "ckpt")
    base = {"stage": 1, "precision": "fp16", "ckpt": ckpt, "steps_to": 10}
    results, ref = _run(tmp_path, 2, dict(base, save_at=[5]), name="fp16ref")
    _ok(results)
    assert ref["skipped_at5"] >= 1 and ref["skipped_final"] > ref["skipped_at5"]  # overflow before and after
    results, out = _run(tmp_path, 2, dict(base, stage=2, load=""), name="fp16resume")
    _ok(results)
    assert (out["scale_after_load"], out["skipped_after_load"]) == (ref["scale_at5"], ref["skipped_at5"])
    for s in range(6, 11):
        assert out["scales"][str(s)] == ref["scales"][str(s)], s
    _assert_losses_match(out["losses"], ref["losses"], range(6, 11))


def test_resume_with_nvme_offload_and_save_from_it(reference, tmp_path):
    """Saved without offload, loaded into an engine whose masters and Adam states live in files
    (offload_optimizer: nvme; a temp dir as the NVMe path); its own save consolidates to the
    uninterrupted run's weights."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference["ckpt"], ckpt)
    (tmp_path / "nvme").mkdir()
    spec = {
        "stage": 2, "ckpt": str(ckpt), "load": "global_step3", "steps_to": 6, "save_at": [5],
        "offload": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")},
    }
    results, out = _run(tmp_path, 2, spec, name="nvme")
    _ok(results)
    _assert_losses_match(out["losses"], reference["losses"], range(4, 7))
    ref5 = torch.load(reference["state_dict5"], weights_only=True)
    consolidate(ckpt, tmp_path / "hf", tag="global_step5")
    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for k in sd:
        torch.testing.assert_close(sd[k], ref5[k], rtol=RTOL, atol=ATOL)


def test_bf16_resume_at_world1_stage0(tmp_path):
    """bf16 (bf16 compute, fp32 masters): saved at world 2 stage 2, resumed at world 1 stage 0;
    losses within the stage tests' bf16 tolerance (2^-7 relative: a 16-bit value may differ
    by one rounding when the fp32 gradient sums run in another order)."""
    ckpt = str(tmp_path / "ckpt")
    results, ref = _run(tmp_path, 2, {"stage": 2, "precision": "bf16", "ckpt": ckpt, "steps_to": 6, "save_at": [3]}, name="bf16ref")
    _ok(results)
    results, out = _run(tmp_path, 1, {"stage": 0, "precision": "bf16", "ckpt": ckpt, "load": "", "steps_to": 6}, name="bf16w1")
    _ok(results)
    for s in range(4, 7):
        assert out["losses"][str(s)] == pytest.approx(ref["losses"][str(s)], rel=2.0**-7), s
    with CheckpointReader(Path(ckpt) / "global_step3") as rd:
        assert rd.meta.precision == "bf16" and rd.params["l1.weight"].dtype == "bfloat16"
        assert rd.read_full("l1.weight").dtype == torch.float32  # the fp32 master is what is stored
