"""load_config: reading, validation messages, aliases, rules, round trips (pure, fast)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from zerorun.config import load_config
from zerorun.errors import ConfigError

DATA = Path(__file__).parent / "data"


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def error_of(source, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source, **kwargs)
    return str(info.value)


# -- the article's own configs -----------------------------------------------------------


def test_article_stage2_config_is_valid_with_warnings():
    loaded = load_config(DATA / "article_stage2.json")
    c = loaded.config
    assert c.zero_optimization.stage == 2
    assert c.zero_optimization.allgather_bucket_size == 200_000_000
    assert isinstance(c.zero_optimization.allgather_bucket_size, int)
    assert c.zero_optimization.offload_optimizer.device == "none"
    assert c.zero_optimization.offload_optimizer.pin_memory is True
    assert c.fp16.enabled == "auto" and c.train_batch_size == "auto"
    text = "\n".join(loaded.warnings)
    # stage3_* keys at stage 2: one warning naming each key and its line
    for key, line in [("stage3_prefetch_bucket_size", 20), ("stage3_max_reuse_distance", 23)]:
        assert f"zero_optimization.{key} (line {line})" in text
    assert "ignored at stage 2" in text
    # amp together with fp16 (the article's section 5.1 trap)
    assert "amp.enabled (line 34)" in text and "fp16" in text
    assert len(loaded.warnings) == 2
    assert set(loaded.open_autos) == {
        "train_batch_size",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "fp16.enabled",
        "amp.enabled",
    }


def test_article_inline_python_config_as_dict():
    # Section 3.1's ds_config, as the runtime receives it (a dict).
    ds_config = {
        "train_batch_size": 32,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 2,
            "allgather_partitions": True,
            "allgather_bucket_size": 5e8,
            "reduce_scatter": True,
            "reduce_bucket_size": 5e8,
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    }
    loaded = load_config(ds_config, world_size=2)
    assert loaded.warnings == [] and loaded.notices == []
    assert loaded.config.zero_optimization.reduce_bucket_size == 500_000_000
    assert loaded.batch is not None
    assert (loaded.batch.train_micro_batch_size_per_gpu, loaded.batch.gradient_accumulation_steps) == (16, 1)
    assert loaded.config.optimizer is not None and loaded.config.optimizer.canonical_type == "AdamW"


def test_hugging_face_zero3_template_is_clean():
    # The Trainer integration's documented ZeRO-3 config: all "auto" values stay open.
    loaded = load_config(DATA / "hf_zero3.json", world_size=8)
    assert loaded.warnings == [] and loaded.notices == []
    assert loaded.batch is not None and set(loaded.batch.open) == {
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    }  # fmt: skip
    assert "optimizer.params.betas" in loaded.open_autos and "zero_optimization.reduce_bucket_size" in loaded.open_autos
    assert loaded.config.zero_optimization.stage3_prefetch_bucket_size == "auto"
    assert loaded.config.mixed_precision == "bf16"


def test_every_documented_deepspeed_key_is_known():
    loaded = load_config(DATA / "deepspeed_all_keys.json")
    c = loaded.config
    assert c.zero_optimization.stage3_model_persistence_threshold == 10**12
    assert c.zero_optimization.offload_optimizer.ratio == 0.3
    # keys zerorun does not act on, set to non-defaults, are noticed -- never silent
    text = "\n".join(loaded.notices)
    for key in ("zero_force_ds_cpu_optimizer", "stage3_model_persistence_threshold", "sparse_attention", "timers", "pipeline"):
        assert key in text, key
    assert "offload_optimizer.ratio" not in text  # acted on (Twin-Flow partial offload)
    # disabled features are accepted silently: nothing is lost
    assert "flops_profiler" not in text and "wandb" not in text
    assert "aio" not in text  # every value DeepSpeed's default: nothing to say


# -- reading -----------------------------------------------------------------------------


def test_json_comments_and_trailing_commas(tmp_path):
    p = write(
        tmp_path,
        "c.json",
        '/* header */\n{\n  "train_batch_size": 8, // inline\n  # hash comment\n'
        '  "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8,},\n  "url": "http://x//y",\n}\n',
    )
    with pytest.raises(ConfigError, match="url"):
        load_config(p)  # "url" is unknown, but the // inside the string was not a comment
    p = write(tmp_path, "d.json", '{"train_batch_size": 8, // c\n "zero_optimization": {"stage": 1,},}\n')
    assert load_config(p).config.zero_optimization.stage == 1


def test_yaml_exponent_numbers_follow_the_schema(tmp_path):
    p = write(
        tmp_path,
        "c.yaml",
        "train_micro_batch_size_per_gpu: 2\n"
        "zero_optimization:\n  stage: 3\n  reduce_bucket_size: 5e8\n  stage3_prefetch_bucket_size: 5E7\n"
        "  stage3_max_live_parameters: 1_000_000\n"
        "optimizer: {type: AdamW, params: {lr: 3e-4, eps: 1e-8, betas: [0.9, 0.95]}}\n"
        "gradient_clipping: 1e0\n"
        "launcher:\n  env: {NCCL_BUFFSIZE: 5e8, OMP_NUM_THREADS: 4, HEX: 0x10, PI: 3.10, TOKENIZERS_PARALLELISM: false}\n",
    )
    c = load_config(p).config
    z = c.zero_optimization
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_max_live_parameters) == (
        500_000_000,
        50_000_000,
        1_000_000,
    )
    assert type(z.reduce_bucket_size) is int
    assert c.optimizer is not None and c.optimizer.params == {"lr": 3e-4, "eps": 1e-8, "betas": [0.9, 0.95]}
    assert c.gradient_clipping == 1.0
    # environment values keep the text exactly as written
    assert c.launcher.env == {
        "NCCL_BUFFSIZE": "5e8", "OMP_NUM_THREADS": "4", "HEX": "0x10", "PI": "3.10", "TOKENIZERS_PARALLELISM": "false",
    }  # fmt: skip
    assert all(type(v) is str for v in c.launcher.env.values())


def test_yaml_anchors_and_merge(tmp_path):
    p = write(
        tmp_path,
        "m.yaml",
        "launcher:\n  env: &e {NCCL_DEBUG: INFO, A: '1'}\n"
        "  host_env:\n    w2:\n      <<: *e\n      A: '2'\n",
    )
    c = load_config(p).config
    assert c.launcher.host_env == {"w2": {"NCCL_DEBUG": "INFO", "A": "2"}}


@pytest.mark.parametrize(
    "name,text,expected",
    [
        ("dup.json", '{\n  "zero_optimization": {"stage": 2,\n    "stage": 3}\n}\n', "line 3: duplicate key 'zero_optimization.stage' (first given at line 2)"),
        ("dup.yaml", "fp16:\n  enabled: true\nfp16:\n  enabled: false\n", "line 3: duplicate key 'fp16' (first given at line 1)"),
        ("bad.json", '{\n  "a": 1\n  "b": 2\n}\n', "invalid JSON at line 3, column 3"),
        ("bad2.json", '{"a": 1,\n "b": tru}\n', "invalid JSON at line 2, column 7"),
        ("after_comments.json", '{\n  // a "quoted" {comment}\n  "a": 1 /* c */ "b": 2\n}', "invalid JSON at line 3, column 18"),
        ("single.json", "{'a': 1}", "double quotes"),
        ("py.json", '{"a": True}', "lower case"),
        ("comment.json", '{"a": 1 /* never closed\n}', "unterminated /* comment"),
        ("bad.yaml", "a: [1, 2\nb: 3\n", "invalid YAML at line 2, column 2"),
        ("tab.yaml", "a:\n\tb: 1\n", "invalid YAML at line 2"),
        ("list.yaml", "- 1\n- 2\n", "the top level must be a mapping"),
        ("scalar.json", "42", "the top level must be a mapping"),
        ("empty.json", "", "the file is empty"),
        ("empty.yaml", "# nothing\n", "the file is empty"),
        ("two.yaml", "a: 1\n---\nb: 2\n", "invalid YAML"),
    ],
)
def test_unreadable_syntax_is_one_clear_error(tmp_path, name, text, expected):
    p = write(tmp_path, name, text)
    message = error_of(p)
    assert expected in message
    assert str(p) in message
    assert "Traceback" not in message


def test_missing_directory_and_binary_files(tmp_path):
    assert "no such config file" in error_of(tmp_path / "nope.json")
    assert "is a directory" in error_of(tmp_path)
    (tmp_path / "bin.json").write_bytes(b'{"a": "\xff\xfe"}')
    assert "not UTF-8" in error_of(tmp_path / "bin.json")
    p = write(tmp_path, "secret.json", "{}")
    if os.geteuid() != 0:
        p.chmod(0)
        assert "permission denied" in error_of(p)


def test_unreadable_file_even_as_root(tmp_path, monkeypatch):
    # root reads anything, so simulate what an unprivileged user gets
    p = write(tmp_path, "secret.json", "{}")

    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", denied)
    assert f"{p}: permission denied" in error_of(p)


# -- validation ----------------------------------------------------------------------------


def test_unknown_keys_have_path_and_did_you_mean():
    assert "zero_optimisation: unknown key in the top level. Did you mean 'zero_optimization'?" in error_of(
        {"zero_optimisation": {"stage": 2}}
    )
    msg = error_of({"zero_optimization": {"stage": 1, "offload_optimizer": {"devise": "cpu"}}})
    assert "zero_optimization.offload_optimizer.devise: unknown key" in msg and "'device'" in msg
    assert "belongs in zero_optimization (zero_optimization.stage)" in error_of({"stage": 3})
    assert "launcher.num_gpus" in error_of({"num_gpus": 2})


def test_unknown_key_reports_its_line(tmp_path):
    p = write(tmp_path, "c.yaml", "train_batch_size: 8\nzero_optimization:\n  stage: 2\n  overlap_com: true\n")
    msg = error_of(p)
    assert "zero_optimization.overlap_com (line 4)" in msg and "overlap_comm" in msg


@pytest.mark.parametrize(
    "config,expected",
    [
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage: 4 is not a ZeRO stage; allowed: 0, 1, 2, 3"),
        ({"zero_optimization": {"stage": "two"}}, "zero_optimization.stage: expected a whole number, got 'two'"),
        ({"train_batch_size": 0}, "train_batch_size: 0 is out of range; it must be ≥ 1"),
        ({"train_batch_size": 2.5}, "train_batch_size: expected a whole number, got 2.5"),
        ({"train_batch_size": "big"}, 'expected a whole number ≥ 1, "auto" or null, got \'big\''),
        ({"train_micro_batch_size_per_gpu": True}, "got the boolean true"),
        ({"fp16": {"enabled": "yes"}}, "fp16.enabled: expected true/false or \"auto\", got 'yes'"),
        ({"fp16": []}, "fp16: expected a mapping (section), got a list"),
        ({"gradient_clipping": -1}, "gradient_clipping: -1 is out of range; it must be ≥ 0"),
        ({"communication_data_type": "fp8"}, 'communication_data_type: expected "fp32" / "fp16" / "bf16" or null'),
        ({"zero_optimization": {"offload_param": {"device": "gpu"}}}, 'expected "none" / "cpu" / "nvme", got \'gpu\''),
        ({"optimizer": {"type": "AdamX"}}, "unknown optimizer 'AdamX'. Did you mean 'Adamax'?"),
        ({"optimizer": {"params": {"lr": 1}}}, "optimizer.type: required key is missing"),
        ({"scheduler": {"type": "warmuplr"}}, "case-sensitive: write 'WarmupLR'"),
        ({"launcher": {"master_port": 70000}}, "launcher.master_port: 70000 is out of range; it must be ≤ 65535"),
        ({"launcher": {"env": {"NCCL_DEBUG": None}}}, "environment values are strings"),
        ({"launcher": {"env": {"1BAD": "x"}}}, "'1BAD' is not a valid environment variable name"),
        ({"launcher": {"device": "tpu"}}, 'launcher.device: expected "cuda" / "cpu" or null'),
        ({"zerorun": {"memory_report_interval": -1}}, "zerorun.memory_report_interval: -1 is out of range"),
        ({"zerorun": {"memory_report_intervall": 2}}, "Did you mean 'memory_report_interval'?"),
    ],
)
def test_wrong_values_name_key_value_and_what_is_allowed(config, expected):
    assert expected in error_of(config)


def test_all_problems_reported_at_once():
    msg = error_of({"train_batch_size": 0, "zero_optimization": {"stage": 9, "stag": 1}})
    assert "3 problems" in msg
    assert msg.index("train_batch_size") < msg.index("zero_optimization.stage:")


def test_cross_field_rules():
    assert "are both true; choose one" in error_of({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    # both "auto" is what Hugging Face writes; the integration enables at most one
    assert load_config({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}).warnings == []

    loaded = load_config({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert any("parameter offload needs zero_optimization.stage 3 (you have 2)" in w for w in loaded.warnings)

    msg = error_of({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}})
    assert "needs zero_optimization.offload_optimizer.nvme_path" in msg
    # a path absent here is only a warning: configs are validated away from the cluster
    loaded = load_config(
        {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/no/such/nvme"}}}
    )
    assert any("does not exist on this machine" in w for w in loaded.warnings)
    assert not any("stage" in w for w in loaded.warnings)  # NVMe optimizer offload is fine at stage 1

    # stage-specific keys of any section (zerorun's own stage3_* options too)
    loaded = load_config({"zero_optimization": {"stage": 1, "contiguous_gradients": False}, "zerorun": {"stage3_check_order": True}})
    text = "\n".join(loaded.warnings)
    assert "zero_optimization.contiguous_gradients: applies at stages 2/3 only; ignored at stage 1" in text
    assert "zerorun.stage3_check_order: applies at stage 3 only; ignored at stage 1" in text

    loaded = load_config({"bf16": {"enabled": True}, "communication_data_type": "fp16"})
    assert any("can exceed fp16's range" in w for w in loaded.warnings)

    loaded = load_config({"amp": {"enabled": True, "opt_level": "O1"}})
    assert any("does not use NVIDIA apex AMP" in w for w in loaded.warnings)
    assert "mutually exclusive" in error_of({"launcher": {"include": "a", "exclude": "b"}})


def test_deprecated_aliases_are_mapped_with_warnings():
    loaded = load_config(
        {
            "bfloat16": {"enabled": True},
            "zero_optimization": {
                "stage": 2,
                "cpu_offload": True,
                "cpu_offload_use_pin_memory": True,
                "stage3_gather_fp16_weights_on_model_save": True,
            },
        }
    )
    c = loaded.config
    assert c.bf16.enabled is True
    assert c.zero_optimization.offload_optimizer.device == "cpu"
    assert c.zero_optimization.offload_optimizer.pin_memory is True
    assert c.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    text = "\n".join(loaded.warnings)
    for old in ("bfloat16", "cpu_offload", "cpu_offload_use_pin_memory", "stage3_gather_fp16_weights_on_model_save"):
        assert old in text

    loaded = load_config({"zero_optimization": True})
    assert loaded.config.zero_optimization.stage == 1 and "deprecated format" in loaded.warnings[0]

    # DeepSpeed's internal short names: accepted like DeepSpeed accepts them
    loaded = load_config({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 1e7, "max_live_parameters": 1e8}})
    assert loaded.config.zero_optimization.stage3_prefetch_bucket_size == 10**7
    assert loaded.config.zero_optimization.stage3_max_live_parameters == 10**8
    assert "two spellings" in error_of(
        {"zero_optimization": {"stage": 3, "prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}}
    )


def test_notices_for_keys_zerorun_does_not_act_on():
    loaded = load_config(
        {
            "prescale_gradients": True,
            "wall_clock_breakdown": False,  # a default: nothing to say
            "comms_logger": {"enabled": True},
            "tensorboard": {"enabled": False, "output_path": "x"},  # disabled: nothing lost
            "zero_optimization": {"stage": 2, "round_robin_gradients": True},
        }
    )
    text = "\n".join(loaded.notices)
    assert "prescale_gradients = true" in text
    assert "comms_logger" in text
    assert "zero_optimization.round_robin_gradients" in text
    assert "wall_clock_breakdown" not in text and "tensorboard" not in text
    assert loaded.warnings == []


def test_keys_zerorun_handles_its_own_way_are_noticed_only_when_they_differ():
    same = load_config(
        {"zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_scatter": True, "contiguous_gradients": True}}
    )
    assert same.notices == []
    loaded = load_config(
        {
            "zero_optimization": {
                "stage": 2,
                "overlap_comm": False,
                "reduce_scatter": False,
                "allgather_bucket_size": 2e8,
                "allgather_partitions": False,
            }
        }
    )
    text = "\n".join(loaded.notices)
    assert "zero_optimization.overlap_comm = false: no effect; zerorun always overlaps" in text
    assert "zero_optimization.reduce_scatter = false: no effect; zerorun always reduce-scatters" in text
    assert "zero_optimization.allgather_bucket_size = 200000000: no effect; zerorun gathers" in text
    assert "allgather_partitions = false" in text


def test_defaults_follow_deepspeed():
    c = load_config({}).config
    z = c.zero_optimization
    assert (z.stage, z.reduce_bucket_size, z.allgather_bucket_size, z.sub_group_size) == (0, 5 * 10**8, 5 * 10**8, 10**9)
    assert (z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (5 * 10**7, 10**5)
    assert (z.stage3_max_live_parameters, z.stage3_max_reuse_distance) == (10**9, 10**9)
    assert z.contiguous_gradients and z.reduce_scatter and z.allgather_partitions
    assert z.overlap_comm is True  # what zerorun does at every stage (DeepSpeed: stage 3 only)
    assert (z.offload_param.device, z.offload_param.buffer_count, z.offload_param.buffer_size) == ("none", 5, 10**8)
    assert (z.offload_optimizer.device, z.offload_optimizer.buffer_count, z.offload_optimizer.pin_memory) == ("none", 4, False)
    f = c.fp16
    assert (f.enabled, f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.min_loss_scale) == (
        False, 0.0, 16, 1000, 2, 1.0,
    )  # fmt: skip
    assert c.gradient_clipping == 0.0 and c.steps_per_print == 10 and c.communication_data_type is None
    assert c.optimizer is None and c.scheduler is None
    assert c.zerorun.memory_report_interval == 5.0 and c.launcher.ranks_per_gpu == 1


def test_round_trip_through_json(tmp_path):
    for source in (DATA / "article_stage2.json", DATA / "deepspeed_all_keys.json"):
        c = load_config(source).config
        again = load_config(json.loads(json.dumps(c.to_dict()))).config
        assert again == c
        full = load_config(json.loads(json.dumps(c.to_dict(only_set=False)))).config
        assert full == c
    # the user's values only, `auto` kept
    c = load_config(DATA / "article_stage2.json").config
    d = c.to_dict()
    assert d["train_batch_size"] == "auto" and "optimizer" not in d and "overlap_comm" in d["zero_optimization"]


def test_null_sections_and_launcher_json():
    loaded = load_config({"fp16": None, "zero_optimization": None, "optimizer": None, "train_batch_size": 8})
    assert loaded.config.fp16.enabled is False and loaded.config.zero_optimization.stage == 0
    # what the launcher sends to the ranks, read back there
    again = load_config(json.loads(loaded.to_json()))
    assert again.config == loaded.config
