"""DeepSpeed's checkpoint files beside zerorun's under --deepspeed-compat
(runtime/checkpoint/deepspeed_layout.py): 2 real ranks save at stages 0, 1 (bf16) and 3 (fp16),
and with two optimizer param groups at stages 2 (fp32) and 3 (bf16), through the layer
(_layout_worker.py). The files carry DeepSpeed's names and keys; rebuilt the way DeepSpeed's
zero_to_fp32.py rebuilds them (below: concatenated partitions per group at stages 1-2, one slice
per parameter and rank at stage 3) they give exactly zerorun's consolidation; the optimizer
states read back from them (read_optim_states) are exactly zerorun's masters, moments, steps and
hyperparameters; a crash just before the commit leaves ``latest`` on the previous tag with the
DeepSpeed files already in the uncommitted directory (they are written before the commit point);
the ``zero_to_fp32.py`` copied into the save directory runs; and zerorun still loads its own files
from there at another world size. DeepSpeed's own script is run on the same cases by
scripts/deepspeed_layout_check.py (its result: benchmarks/results/deepspeed_layout_check.json)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from zerorun.runtime.checkpoint import get_fp32_state_dict

from ._run import PYTHON, env, launch

CASES = ["s0-fp32", "s1-bf16", "s3-fp16", "s2-fp32-2g", "s3-bf16-2g", "s2-bf16-async"]
CRASHED = "s2-bf16"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("layout")
    launch(["--num_gpus", "2", "--device", "cpu", "tests/compat/_layout_worker.py", str(out), *CASES], timeout=240)
    launch(["--num_gpus", "1", "--device", "cpu", "tests/compat/_layout_worker.py", str(out), "load", "s3-fp16"], timeout=240)
    with pytest.raises(AssertionError, match="exit"):  # rank 0 SIGKILLed itself: the job fails
        launch(["--num_gpus", "2", "--device", "cpu", "tests/compat/_layout_worker.py", str(out), "crash", CRASHED],
               timeout=240)
    return out


def _load(path: Path) -> dict:
    from zerorun.runtime.checkpoint.deepspeed_files import load_file

    return load_file(path)  # DeepSpeed's loss-scaler object inside, DeepSpeed not installed here


def _rebuild(tag_dir: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's zero_to_fp32 reconstruction (deepspeed/utils/zero_to_fp32.py), condensed."""
    optim = sorted(tag_dir.glob("*_optim_states.pt"), key=lambda p: int(p.name.split("rank_")[1].split("_")[0]))
    states = [_load(p)["optimizer_state_dict"] for p in optim]
    stage, world = states[0]["zero_stage"], states[0]["partition_count"]
    world = max(world) if isinstance(world, list) else world
    assert world == len(optim)
    model_files = sorted(tag_dir.glob("*_model_states.pt"))
    model = _load(model_files[0])
    sd = {k: v.float() for k, v in model["module"].items() if k in model["buffer_names"]}
    if stage <= 2:
        sd.update(model["frozen_param_fragments"] or {})
        for g, shapes in enumerate(model["param_shapes"]):
            flat = torch.cat([s["single_partition_of_fp32_groups"][g] for s in states])
            offset = 0
            for name, shape in shapes.items():
                sd[name] = flat.narrow(0, offset, shape.numel()).view(shape)
                offset += shape.numel()
            align = 2 * world
            assert math.ceil(offset / align) * align == math.ceil(flat.numel() / align) * align
    else:
        ranks = [_load(p) for p in sorted(model_files)]
        for name, shape in (model["frozen_param_shapes"] or {}).items():
            sd[name] = torch.cat([m["frozen_param_fragments"][name] for m in ranks]).narrow(0, 0, shape.numel()).view(shape)
        flats = [torch.cat(s["fp32_flat_groups"]) for s in states]
        offset = 0
        for name, shape in ((n, s) for group in model["param_shapes"] for n, s in group.items()):
            chunk = math.ceil(shape.numel() / world)
            sd[name] = torch.cat([f[offset : offset + chunk] for f in flats])[: shape.numel()].view(shape)
            offset += chunk
        assert offset * world == flats[0].numel() * world
    for alias, name in model["shared_params"].items():
        sd[alias] = sd[name]
    return sd


def _ds_files(tag_dir: Path) -> list[str]:
    return sorted(p.name for p in tag_dir.iterdir() if not p.name.startswith(("shard_", "rng_")))


def test_files_have_deepspeeds_names(saved: Path) -> None:
    files = {case: _ds_files(saved / case / "global_step3") for case in CASES}
    zerorun_own = ["engine_state.pt", "zerorun_checkpoint.json"]
    assert files["s0-fp32"] == sorted(["mp_rank_00_model_states.pt", *zerorun_own])
    assert files["s1-bf16"] == sorted([
        "mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", *zerorun_own,
    ])
    assert files["s3-fp16"] == sorted([
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt", *zerorun_own,
    ])
    for case in CASES:
        assert (saved / case / "latest").read_text().strip() == "global_step3"
        assert (saved / case / "zero_to_fp32.py").is_file()


@pytest.mark.parametrize("case", ["s1-bf16", "s3-fp16", "s2-fp32-2g", "s3-bf16-2g"])
def test_deepspeed_reconstruction_equals_zeroruns_consolidation(saved: Path, case: str) -> None:
    want = get_fp32_state_dict(saved / case)
    got = _rebuild(saved / case / "global_step3")
    assert sorted(got) == sorted(want)  # tied alias, frozen parameter, persistent buffer
    for name, value in want.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], value.reshape(got[name].shape)), name


def test_module_in_model_states_is_the_16bit_state_dict(saved: Path) -> None:
    model = _load(saved / "s1-bf16" / "global_step3" / "mp_rank_00_model_states.pt")
    want = get_fp32_state_dict(saved / "s1-bf16")
    module = model["module"]
    assert sorted(module) == sorted(want) and "scratch" not in module  # not the non-persistent buffer
    # The engine casts the whole module (buffers too) to bf16, as DeepSpeed does.
    assert module["body.0.weight"].dtype == torch.bfloat16 and module["scale"].dtype == torch.bfloat16
    for name, value in want.items():
        assert torch.equal(module[name].float(), value.to(module[name].dtype).float().reshape(module[name].shape)), name
    assert model["buffer_names"] == ["scale"] and model["shared_params"] == {"head.weight": "emb.weight"}
    assert model["global_steps"] == 3 and model["dp_world_size"] == 2 and model["ds_config"]["zero_optimization"]["stage"] == 1


def test_copied_recovery_script_consolidates(saved: Path, tmp_path: Path) -> None:
    script = saved / "s3-fp16" / "zero_to_fp32.py"
    proc = subprocess.run([PYTHON, str(script), str(saved / "s3-fp16"), str(tmp_path / "out")],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = torch.load(tmp_path / "out" / "pytorch_model.bin")
    want = get_fp32_state_dict(saved / "s3-fp16")
    for name in got:
        assert torch.equal(got[name].reshape(-1), want[name].reshape(-1)), name


def test_recovery_script_takes_sizes_as_zerorun_consolidate_does(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from zerorun.runtime.checkpoint.recovery_script import main

    # Binary units too (HF's convention, which DeepSpeed's own script follows): shards of 1 KiB.
    assert main([str(saved / "s3-fp16"), str(tmp_path / "out"), "--max_shard_size", "1KiB"]) == 0
    index = json.loads((tmp_path / "out" / "pytorch_model.bin.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    got: dict[str, torch.Tensor] = {}
    for f in files:
        got.update(torch.load(tmp_path / "out" / f))
    want = get_fp32_state_dict(saved / "s3-fp16")
    tied = index["metadata"]["zerorun_tied"]  # aliases stored once
    assert {n for n in want if n not in tied} <= set(got)
    assert all(torch.equal(got[n].reshape(-1), want[n].reshape(-1)) for n in want if n not in tied)
    # A bad size is a message and exit 1, not a traceback.
    assert main([str(saved / "s3-fp16"), str(tmp_path / "o2"), "--max_shard_size", "lots"]) == 1
    assert "--max_shard_size 'lots'" in capsys.readouterr().err


def test_zerorun_loads_its_own_files_there_at_another_world_size(saved: Path) -> None:
    loaded = torch.load(saved / "s3-fp16-loaded.pt")  # saved by 2 ranks at stage 3, loaded by 1 at stage 2
    want = get_fp32_state_dict(saved / "s3-fp16")
    for name, value in loaded.items():
        assert torch.equal(value.float().reshape(-1), want[name].float().reshape(-1)), name



@pytest.mark.parametrize("case", ["s1-bf16", "s3-fp16", "s2-fp32-2g", "s3-bf16-2g", "s2-bf16-async"])
def test_optimizer_states_round_trip(saved: Path, case: str) -> None:
    from zerorun.runtime.checkpoint import CheckpointReader
    from zerorun.runtime.checkpoint.deepspeed_read import read_optim_states

    tag = saved / case / "global_step3"
    got = read_optim_states(tag)
    stage = int(case[1])
    assert got.stage == stage and got.world_size == 2
    with CheckpointReader(tag) as zr:
        meta = zr.meta
        trained = [p.name for p in meta.params if p.requires_grad and zr.has(p.name, "weight")]
        assert sorted(n for g in got.groups for n in g) == sorted(trained)
        for name in trained:
            assert sorted(got.tensors[name]) == ["exp_avg", "exp_avg_sq", "fp32"], name
            for kind, zr_kind in (("fp32", "weight"), ("exp_avg", "optim.exp_avg"), ("exp_avg_sq", "optim.exp_avg_sq")):
                want = zr.read_full(name, zr_kind, dtype=torch.float32)
                assert torch.equal(got.tensors[name][kind].reshape(-1), want), (name, kind)
            assert got.tensors[name]["exp_avg_sq"].abs().sum() > 0  # trained: real moments, not zeros
        want_groups = meta.optimizer["param_groups"]
        assert len(got.groups) == len(want_groups) == (2 if case.endswith("-2g") else 1)
        for g, hyper in enumerate(got.param_groups):
            assert hyper["lr"] == want_groups[g]["lr"] and hyper["weight_decay"] == want_groups[g]["weight_decay"]
            assert float(got.scalars[g]["step"]) == float(meta.optimizer["scalar_state"][g]["step"]) == 3.0
    if case.endswith("-2g"):  # biases in the second group, weights in the first
        assert all(n.endswith("bias") for n in got.groups[1]) and not any(n.endswith("bias") for n in got.groups[0])


def test_stage3_module_holds_deepspeeds_placeholders(saved: Path) -> None:
    # DeepSpeed's stage-3 load matches `module` key for key (strict): every parameter, as the
    # empty tensor its partitioned parameters hold, in the compute dtype; the buffers whole.
    model = _load(saved / "s3-fp16" / "global_step3" / "zero_pp_rank_1_mp_rank_00_model_states.pt")
    want = get_fp32_state_dict(saved / "s3-fp16")
    assert sorted(model["module"]) == sorted(want)  # tied alias and frozen parameter included
    for name, value in model["module"].items():
        if name in model["buffer_names"]:
            assert torch.equal(value.float(), want[name].float()), name
        else:
            assert value.numel() == 0 and value.dtype == torch.float16, name


@pytest.mark.parametrize("case", ["s2-fp32-2g", "s3-bf16-2g"])
def test_each_group_is_flattened_in_the_order_the_script_gave(saved: Path, case: str) -> None:
    # DeepSpeed places a group's partitions by position, in the order of the group's parameter
    # list (here: named_parameters order); zerorun's own buffers hold them in gradient order.
    model = _load(next((saved / case / "global_step3").glob("*model_states.pt")))
    assert [list(g) for g in model["param_shapes"]] == [
        ["emb.weight", "body.0.weight", "body.2.weight"], ["frozen.bias", "body.0.bias", "body.2.bias"]]


def test_optimizer_file_keys_are_deepspeeds(saved: Path) -> None:
    s12 = _load(saved / "s2-fp32-2g" / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert {"base_optimizer_state", "single_partition_of_fp32_groups", "group_paddings", "partition_count",
            "zero_stage", "clip_grad", "ds_version"} <= set(s12)
    assert s12["zero_stage"] == 2 and s12["partition_count"] == [2, 2]
    base = s12["base_optimizer_state"]
    for g in (0, 1):  # the rigid form: the padded partition, the padding at the end
        padded = base["state"][g]["exp_avg"].numel()
        assert padded == s12["single_partition_of_fp32_groups"][g].numel() + s12["group_paddings"][g]
        assert padded % 2 == 0 and base["param_groups"][g]["params"] == [g]
    s3 = _load(saved / "s3-bf16-2g" / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert {"fp32_flat_groups", "optimizer_state_dict", "partition_count", "zero_stage", "loss_scaler"} <= set(s3)
    # DeepSpeed's own scaler classes (its loader calls them), with zerorun's scaler state.
    scaler = s3["loss_scaler"]
    assert scaler.path == "deepspeed.runtime.fp16.loss_scaler.LossScaler" and scaler.attributes == {"cur_scale": 1.0, "dynamic": False}
    fp16 = _load(saved / "s3-fp16" / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    dyn = fp16["loss_scaler"]
    assert dyn.path == "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler" and fp16["dynamic_loss_scale"] is True
    ours = torch.load(saved / "s3-fp16" / "global_step3" / "engine_state.pt", weights_only=False)["loss_scaler"]
    assert (dyn.attributes["cur_scale"], dyn.attributes["cur_iter"]) == (ours["scale"], ours["cur_iter"]) == (16.0, 3)
    assert dyn.attributes["dtype"] == torch.float16 and dyn.attributes["scale_window"] == 1000
    assert s3["partition_count"] == 2 and len(s3["fp32_flat_groups"]) == 2
    assert [t.numel() for t in s3["fp32_flat_groups"]] == [
        s3["optimizer_state_dict"]["state"][g]["exp_avg"].numel() for g in (0, 1)
    ]


def test_crash_before_commit_leaves_latest_on_the_previous_complete_tag(saved: Path) -> None:
    root = saved / CRASHED
    assert (root / "latest").read_text().strip() == "global_step3"
    assert not (root / "global_step6").exists()
    # The DeepSpeed files were in the uncommitted directory before the commit point.
    assert _ds_files(root / ".tmp-global_step6") == sorted([
        "mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "engine_state.pt", "zerorun_checkpoint.json",
    ])
    assert sorted(p.name for p in (root / "global_step3").glob("*optim_states.pt")) == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]


@pytest.mark.parametrize("case", ["s1-bf16", "s3-bf16-2g"])
def test_a_param_group_without_parameters(saved: Path, case: str, tmp_path: Path) -> None:
    """A group the engine holds no trainable parameter in (Trainer's no-decay group of a model
    without biases, say) is an empty partition, not an error."""
    import shutil

    from zerorun.runtime.checkpoint import CheckpointReader
    from zerorun.runtime.checkpoint.deepspeed_layout import write_rank_files
    from zerorun.runtime.checkpoint.deepspeed_read import read_optim_states

    tag = tmp_path / "global_step3"
    shutil.copytree(saved / case / "global_step3", tag)
    for stale in [*tag.glob("*_optim_states.pt"), *tag.glob("*_model_states.pt")]:
        stale.unlink()
    with CheckpointReader(tag) as zr:
        names = [p.name for p in zr.meta.params if p.requires_grad and zr.has(p.name, "weight")]
    for rank in (0, 1):
        write_rank_files(tag, rank, groups=[names, []])
    got = read_optim_states(tag)
    assert got.groups == [names, []]
    with CheckpointReader(tag) as zr:
        for name in names:
            assert torch.equal(got.tensors[name]["exp_avg"].reshape(-1), zr.read_full(name, "optim.exp_avg", dtype=torch.float32))


@pytest.mark.parametrize("case", ["s0-fp32", "s1-bf16", "s3-fp16", "s2-fp32-2g", "s3-bf16-2g"])
def test_deepspeeds_files_alone_give_the_weights(saved: Path, case: str, tmp_path: Path) -> None:
    """A checkpoint holding only DeepSpeed's files (as DeepSpeed itself writes them, before a
    switch to zerorun): deepspeed.utils.zero_to_fp32 under the layer reads them in that layout
    and gives exactly zerorun's consolidation of the full checkpoint."""
    import shutil

    from zerorun.compat.deepspeed.utils.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    root = tmp_path / "ds-only"
    shutil.copytree(saved / case / "global_step3", root / "global_step3")
    (root / "latest").write_text("global_step3")
    for ours in root.glob("global_step3/*"):
        if ours.name.startswith(("shard_", "rng_")) or ours.name in ("zerorun_checkpoint.json", "engine_state.pt"):
            ours.unlink()
    got = get_fp32_state_dict_from_zero_checkpoint(root)
    want = get_fp32_state_dict(saved / case)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], value.reshape(got[name].shape)), name
    if case == "s0-fp32":  # load_state_dict_from_zero_checkpoint too, into a plain module
        module = torch.nn.Module()
        module.scale = torch.nn.Parameter(torch.zeros(2))
        load_state_dict_from_zero_checkpoint(module, root)
        assert torch.equal(module.scale.data, want["scale"])
