"""zerorun.initialize as a user meets it: errors, optimizers, schedulers, data, memory provider."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ._spawn import spawn_ranks

HERE = Path(__file__).resolve().parent
CHECKS = [
    "check_accumulation_survives_zero_grad",
    "check_activation_checkpointing",
    "check_adam_means_adamw",
    "check_auto_lr_without_optimizer",
    "check_backward_twice_without_step",
    "check_callable_scheduler_and_config_scheduler",
    "check_delayed_update_warmup_continues_after_resume",
    "check_fp16_auto",
    "check_launcher_config_needs_no_yaml_or_typer",
    "check_memory_provider_registered",
    "check_model_parameters_groups",
    "check_no_optimizer",
    "check_non_elementwise_user_optimizer",
    "check_offload_cpu_step_failure_raises_instead_of_hanging",
    "check_optimizer_of_another_model",
    "check_param_outside_optimizer_is_left_alone",
    "check_plain_loss_backward_then_step",
    "check_scheduler_bound_elsewhere",
    "check_stage_out_of_range",
    "check_training_data_loader",
    "check_unsupported_optimizer_type",
    "check_user_optimizer_groups_match_plain_pytorch",
]


@pytest.fixture(scope="module")
def api_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("api") / "api.json"
    spawn_ranks(HERE / "_api_worker.py", 1, [str(out)], deadline_s=120)
    return json.loads(out.read_text())


def test_every_check_ran(api_results: dict[str, str]) -> None:
    assert sorted(api_results) == CHECKS


@pytest.mark.parametrize("check", CHECKS)
def test_api(api_results: dict[str, str], check: str) -> None:
    assert api_results[check] == "ok", api_results[check]


def test_the_launchers_batch_replaces_the_configs_triad_at_its_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """ZERORUN_BATCH (a restart without failed nodes, launch/job.py): at its world size it
    replaces the config's triad, which is not checked against that world size; at another world
    size it is ignored; a malformed value is a clear error."""
    from zerorun.errors import RuntimeConfigError
    from zerorun.runtime.api import load_runtime_config

    config = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2}
    batch = {"world_size": 2, "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    monkeypatch.setenv("ZERORUN_BATCH", json.dumps(batch))
    cfg = load_runtime_config(config, 2)  # 6 / (2 x 2) would not divide: no error
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (4, 2, 1)
    assert load_runtime_config(config, 3).train_batch_size == 6
    monkeypatch.setenv("ZERORUN_BATCH", '{"world_size": 2}')
    with pytest.raises(RuntimeConfigError, match="ZERORUN_BATCH"):
        load_runtime_config(config, 2)
