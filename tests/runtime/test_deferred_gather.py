"""Stages 1-2 leave the all-gather of the updated parameters in flight when step() returns
(FlatStage.wait_params, docs/runtime.md "The parameter all-gather after the step"): every path
that reads parameters through zerorun waits for it and sees the updated values. Two gloo CPU
ranks, and one rank with real collectives (ZERORUN_DEBUG_COLLECTIVES=1, the GPU check's mode).
The numerics of training with the deferral are test_equivalence.py's (stages 0-2 vs PyTorch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ._spawn import spawn_ranks

HERE = Path(__file__).resolve().parent
CASES = ["z1-bf16-pipelined", "z2-bf16-pipelined", "z2-fp32-pipelined", "z2-bf16-one-part", "z2-bf16-offload"]
CHECKS = [
    "forward",
    "eval_forward_of_the_module",
    "state_dict",
    "state_dict_on_rank0_only",
    "gathered_parameters",
    "save_16bit_model",
    "save_checkpoint",
    "load_checkpoint",
    "destroy",
]
WORLDS = {"w2": (2, {}), "w1-debug-collectives": (1, {"ZERORUN_DEBUG_COLLECTIVES": "1"})}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for key, (world, env) in WORLDS.items():
        base = tmp_path_factory.mktemp(f"deferred-{key}")
        spawn_ranks(
            HERE / "_deferred_gather_worker.py",
            world,
            [str(base / "results.json"), str(base)],
            deadline_s=240,
            extra_env=env,
        )
        out[key] = json.loads((base / "results.json").read_text())
    return out


def test_every_check_ran(results: dict[str, dict[str, str]]) -> None:
    for key in WORLDS:
        assert sorted(results[key]) == sorted(f"{c}/{k}" for c in CASES for k in CHECKS)


@pytest.mark.parametrize("world", list(WORLDS))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("check", CHECKS)
def test_reads_after_step_wait_for_the_gather(results: dict[str, dict[str, str]], world: str, case: str, check: str) -> None:
    assert results[world][f"{case}/{check}"] == "ok", results[world][f"{case}/{check}"]
