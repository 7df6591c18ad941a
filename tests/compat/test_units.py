"""Pieces of the layer that need no process group: optimizers, config resolution, argument
parsing, checkpoint helpers, and what the launcher does with --deepspeed-compat (dry runs)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from zerorun.compat.deepspeed import add_config_arguments
from zerorun.compat.deepspeed._config_view import NO_PERIODIC_PRINTS, runtime_view
from zerorun.compat.deepspeed._initialize import _config_dict, check_not_accelerate_on_cpu_ranks
from zerorun.compat.deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from zerorun.compat.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from zerorun.compat.deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
from zerorun.errors import RuntimeConfigError

from ._run import run


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]


@pytest.mark.parametrize("adamw", [True, False])
def test_cpu_adam_honours_per_group_hyperparameters(adamw: bool) -> None:
    """accelerate replaces the Trainer's optimizer by DeepSpeedCPUAdam(its param_groups, lr=,
    weight_decay=, adamw_mode=): betas/eps/weight decay of each group must survive."""
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    a = _params(0)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    hf = cls(
        [
            {"params": a[:1], "lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1},
            {"params": a[1:], "lr": 0.02, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0},
        ],
        lr=0.05,
        weight_decay=0.3,
    )
    reference = cls(
        [dict(g, params=[q]) for g, q in zip(hf.param_groups, b, strict=True)], lr=0.05, weight_decay=0.3
    )
    ds = DeepSpeedCPUAdam(hf.param_groups, lr=0.05, weight_decay=0.3, adamw_mode=adamw)
    assert [g["params"] for g in hf.param_groups] == [a[:1], a[1:]]  # the Trainer's groups untouched
    assert hf.param_groups[0] is not ds.param_groups[0]
    for step in range(3):
        for p, q in zip(a, b, strict=True):
            grad = torch.full_like(p, 0.1 * (step + 1)) + p.detach() * 0.01
            p.grad, q.grad = grad.clone(), grad.clone()
        ds.step()
        reference.step()
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)


def test_optimizer_standins_refuse_what_they_cannot_do() -> None:
    with pytest.raises(RuntimeConfigError, match="bias_correction"):
        DeepSpeedCPUAdam(_params(0), bias_correction=False)
    with pytest.raises(RuntimeConfigError, match="AMSGrad"):
        FusedAdam(_params(0), amsgrad=True)


def test_config_comes_from_where_deepspeed_takes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, // comment\n "zero_optimization": {"stage": 2}}')
    monkeypatch.delenv("ZERORUN_CONFIG_JSON", raising=False)
    monkeypatch.delenv("ZERORUN_CONFIG", raising=False)
    args = argparse.Namespace(deepspeed_config=str(path))
    assert _config_dict(args, None, None)["zero_optimization"] == {"stage": 2}
    given = {"zero_optimization": {"stage": 1}}
    assert _config_dict(None, None, given) is given  # engine.config is the caller's dict
    with pytest.raises(RuntimeConfigError, match="config twice"):
        _config_dict(args, given, None)
    with pytest.raises(RuntimeConfigError, match="no config"):
        _config_dict(None, None, None)
    monkeypatch.setenv("ZERORUN_CONFIG_JSON", json.dumps(given))
    assert _config_dict(argparse.Namespace(), None, None) == given
    # accelerate's "never print": a step count no run reaches (test_initialize_steps_per_print.py).
    assert runtime_view({"steps_per_print": float("inf"), "a": 1}) == {"steps_per_print": NO_PERIODIC_PRINTS, "a": 1}
    assert runtime_view({"steps_per_print": 5})["steps_per_print"] == 5


def test_accelerate_on_several_cpu_ranks_is_refused_with_the_reason() -> None:
    hf = {"ACCELERATE_USE_DEEPSPEED": "true"}
    with pytest.raises(RuntimeConfigError, match="accelerate counts one process on CPU"):
        check_not_accelerate_on_cpu_ranks(hf, world_size=2, cuda=False)
    check_not_accelerate_on_cpu_ranks(hf, world_size=1, cuda=False)  # one CPU process works
    check_not_accelerate_on_cpu_ranks(hf, world_size=2, cuda=True)
    check_not_accelerate_on_cpu_ranks({}, world_size=2, cuda=False)  # DeepSpeed scripts: fine


def test_add_config_arguments() -> None:
    parser = add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json"


def test_clone_tensors_for_torch_save_copies_views() -> None:
    flat = torch.arange(10.0)
    item = {"a": flat[:3], "b": [flat[3:5], (flat[5:6], 7)]}
    out = clone_tensors_for_torch_save(item)
    assert out["a"].untyped_storage().nbytes() == 3 * 4
    assert out["b"][1][1] == 7 and torch.equal(out["b"][0], flat[3:5])
    assert VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]


def _dry_run(*args: str) -> str:
    return run(["-m", "zerorun", "--dry-run", "--num_gpus", "2", "--device", "cpu", *args], timeout=60).stdout


def test_launcher_switch_sets_the_variable_and_local_rank(tmp_path: Path) -> None:
    # examples/toy.py does not declare --local_rank: passed only with --deepspeed-compat, as
    # DeepSpeed's launcher passes it to every script.
    plain = _dry_run("examples/toy.py")
    assert "ZERORUN_DEEPSPEED_COMPAT" not in plain and "--local_rank" not in plain
    compat = _dry_run("--deepspeed-compat", "examples/toy.py")
    assert "ZERORUN_DEEPSPEED_COMPAT=1" in compat and "examples/toy.py --local_rank=0" in compat
    assert "--local_rank" not in _dry_run("--deepspeed_compat", "--no-local-rank", "examples/toy.py")
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "launcher": {"deepspeed_compat": True}}))
    from_config = _dry_run("examples/toy.py", "--deepspeed", str(cfg))
    assert "ZERORUN_DEEPSPEED_COMPAT=1" in from_config and "--local_rank=0" in from_config


def test_the_switch_reaches_remote_nodes_through_the_wire() -> None:
    """Remote node agents rebuild the plan from the wire: the variable and --local_rank survive."""
    from zerorun.launch import wire
    from zerorun.launch.hosts import parse_hostfile_text
    from zerorun.launch.local import DeviceInfo
    from zerorun.launch.plan import LaunchOptions, Target, build_plan

    opts = LaunchOptions(target=Target(script="train.py"), device="cpu", deepspeed_compat=True)
    plan = build_plan(
        opts, parse_hostfile_text("n1 slots=1\nn2 slots=1\n"), DeviceInfo(gpus=(), cores=2),
        master_port=29500, run_id="r1", local_rank_arg="--local_rank",
    )
    again = wire.plan_from_dict(wire.decode(wire.encode("plan", plan=wire.plan_to_dict(plan)))["plan"])
    remote = again.nodes[1].ranks[0]
    assert again.rank_env(remote)["ZERORUN_DEEPSPEED_COMPAT"] == "1"
    assert again.rank_argv(remote, "python")[-1] == "--local_rank=0"


def test_forgetting_the_switch_says_how_to_run_it(tmp_path: Path) -> None:
    import subprocess

    from ._run import PYTHON, ROOT, env

    script = tmp_path / "train.py"
    script.write_text("import deepspeed\n")
    proc = subprocess.run(
        [PYTHON, "-m", "zerorun", "--num_gpus", "1", "--device", "cpu", str(script)],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1
    assert "launch it with `zerorun --deepspeed-compat ...`" in proc.stdout + proc.stderr
