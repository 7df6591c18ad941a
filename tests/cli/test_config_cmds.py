"""print-config and estimate, in-process (the commands' real entry), plus one real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zerorun.cli import config_cmds, estimate_cmd

REPO = Path(__file__).resolve().parents[2]
ARTICLE = REPO / "tests" / "config" / "data" / "article_stage2.json"
TEMPLATES = sorted((REPO / "templates").glob("*.yaml")) + sorted((REPO / "templates").glob("*.json"))


def run(app, args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        app(args, prog_name="zerorun")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def flat(text: str) -> str:
    return " ".join(text.split())


def test_templates_exist_in_both_formats():
    names = {p.stem for p in TEMPLATES}
    assert names == {"zero1", "zero2", "zero3", "zero3-offload", "zero3-nvme"}
    assert len(TEMPLATES) == 10


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_every_template_passes_print_config_without_warnings(template, capsys):
    code, out, err = run(config_cmds.app, [str(template), "--world-size", "8", "--json"], capsys)
    assert code == 0, out + err
    doc = json.loads(out)
    assert doc["valid"] and doc["warnings"] == [] and doc["notices"] == [], doc["warnings"] + doc["notices"]
    assert doc["batch"]["open"] == [] and doc["open_autos"] == []
    first = template.read_text().lstrip()
    assert first.startswith(("#", "//")), "templates start with a header comment saying when to use them"


def test_yaml_and_json_templates_say_the_same():
    from zerorun.config import load_config

    for stem in ("zero1", "zero2", "zero3", "zero3-offload", "zero3-nvme"):
        loaded = load_config(REPO / "templates" / f"{stem}.yaml")
        y, j = loaded.config, load_config(REPO / "templates" / f"{stem}.json").config
        assert y.to_dict() == j.to_dict(), stem
        # what the launcher hands to every rank (ZERORUN_CONFIG_JSON) reads back the same
        assert load_config(json.loads(loaded.to_json())).config == y, stem


def test_print_config_article_config(capsys):
    code, out, err = run(config_cmds.app, [str(ARTICLE), "--num_gpus", "2", "--params", "7B"], capsys)
    text = flat(out)
    assert code == 0, out + err
    assert "zero_optimization.stage * 2" in text
    assert "warnings (2)" in text and "ignored at stage 2" in text and "amp.enabled (line 34)" in text
    assert "to be filled by the training script / integration" in text
    assert "world size: 2 per node × 1 node(s) = 2" in text
    assert "memory of model states" in text and "activations not included" in text
    assert "allgather_bucket_size (line 14) = 200000000: no effect" in text
    assert "valid: 2 warnings, 1 notice" in text


def test_print_config_batch_arithmetic_and_spellings(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text("train_batch_size: 64\ntrain_micro_batch_size_per_gpu: 4\nzero_optimization: {stage: 1}\n")
    for args in (["--world-size", "8"], ["--world_size=8"], ["--num_gpus", "4", "--num_nodes", "2"], ["--num-gpus=4", "--num-nodes=2"]):
        code, out, err = run(config_cmds.app, [str(p), *args], capsys)
        assert code == 0, out + err
        assert "accum = train 64 / (micro 4 × world size 8) = 2" in flat(out), args
    code, out, err = run(config_cmds.app, [str(p), "--world-size", "3"], capsys)
    assert code == 1
    assert "train_batch_size 64 is not divisible by train_micro_batch_size_per_gpu 4 × world size 3 = 12" in flat(err)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nworker-1 slots=4\nworker-2 slots=4\n")
    code, out, err = run(config_cmds.app, [str(p), "--hostfile", str(hostfile)], capsys)
    assert code == 0 and "= 8" in out and "accum = train 64 / (micro 4 × world size 8) = 2" in flat(out)
    # the config's own launcher section gives the world size when no flag does
    q = tmp_path / "l.yaml"
    q.write_text("train_micro_batch_size_per_gpu: 2\nlauncher: {num_gpus: 3}\n")
    code, out, err = run(config_cmds.app, [str(q)], capsys)
    assert code == 0 and "train = micro 2 × 1 × world size 3 = 6" in flat(out)
    code, out, err = run(config_cmds.app, [str(q), "--num-gpus", "5"], capsys)  # the flag wins
    assert "world size 5 = 10" in flat(out)
    # a hostfile named in the config is relative to the config's directory
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "hosts").write_text("a slots=2\nb slots=2\nc slots=2\n")
    r = tmp_path / "sub" / "h.yaml"
    r.write_text("train_micro_batch_size_per_gpu: 1\nlauncher: {hostfile: hosts, num_nodes: 2}\n")
    code, out, err = run(config_cmds.app, [str(r)], capsys)
    assert code == 0 and "train = micro 1 × 1 × world size 4 = 4" in flat(out), out + err
    code, out, err = run(config_cmds.app, [str(r), "--num_gpus", "1"], capsys)  # first slot of each of 2 hosts
    assert code == 0 and "world size 2 = 2" in flat(out), out + err
    r.write_text("train_micro_batch_size_per_gpu: 1\nlauncher: {hostfile: elsewhere, num_gpus: 4}\n")
    code, out, err = run(config_cmds.app, [str(r)], capsys)  # validated away from the cluster
    assert code == 0 and "is not on this machine" in out and "world size 4 = 4" in flat(out), out + err
    r.write_text("train_micro_batch_size_per_gpu: 1\nlauncher: {hostfile: hosts, num_nodes: 2}\n")
    (tmp_path / "sub" / "hosts").write_text("a slots=x\n")
    code, out, err = run(config_cmds.app, [str(r)], capsys)
    assert code == 1 and "hosts" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "content,needle",
    [
        ('{"zero_optimisation": {"stage": 2}}', "Did you mean 'zero_optimization'?"),
        ('{\n  "a": 1\n  "b": 2\n}', "invalid JSON at line 3, column 3"),
        ("[1, 2]", "the top level must be a mapping"),
        ('{"fp16": {"enabled": true}, "bf16": {"enabled": true}}', "are both true; choose one"),
        ('{"zero_optimization": {"stage": "three"}, "train_batch_size": -1}', "2 problems"),
    ],
)
def test_print_config_errors_exit_1_without_traceback(tmp_path, capsys, content, needle):
    p = tmp_path / "bad.json"
    p.write_text(content)
    code, out, err = run(config_cmds.app, [str(p)], capsys)
    assert code == 1
    assert needle in flat(err) and str(p) in err
    assert "Traceback" not in out + err
    code, out, err = run(config_cmds.app, [str(p), "--json"], capsys)
    assert code == 1
    doc = json.loads(out)
    assert doc["valid"] is False and any(needle in e for e in doc["errors"]) or needle == "2 problems"
    if needle == "2 problems":
        assert len(doc["errors"]) == 2


def test_print_config_missing_file_and_bad_options(tmp_path, capsys):
    code, out, err = run(config_cmds.app, [str(tmp_path / "none.yaml")], capsys)
    assert code == 1 and "no such config file" in flat(err) and "Traceback" not in err
    code, out, err = run(config_cmds.app, [str(ARTICLE), "--world-size", "2", "--num-gpus", "2"], capsys)
    assert code == 2 and "not both" in flat(err)
    code, out, err = run(config_cmds.app, [str(ARTICLE), "--params", "lots"], capsys)
    assert code == 2 and "not a count" in flat(err)


def test_print_config_json_document(capsys):
    code, out, err = run(config_cmds.app, [str(ARTICLE), "--world-size", "4", "--params", "1e9", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["world_size"] == 4 and doc["format"] == "json"
    assert doc["config"]["zero_optimization"]["stage3_max_live_parameters"] == 10**9
    assert doc["user_config"]["train_batch_size"] == "auto"
    assert "zero_optimization.stage" in doc["non_default"] and "zero_optimization.reduce_scatter" not in doc["non_default"]
    assert doc["memory"]["per_rank"]["gpu"]["params"] == 2e9
    assert len(doc["warnings"]) == 2


def test_estimate_reproduces_the_paper(capsys):
    code, out, err = run(estimate_cmd.app, ["--params", "7.5e9", "--gpus-per-node", "8", "--nodes", "8"], capsys)
    assert code == 0, err
    lines = {tuple(line.split()[:2]): line for line in out.splitlines() if line.strip()[:1].isdigit()}
    for stage, gb in (("0", "120.0"), ("1", "31.4"), ("2", "16.6"), ("3", "1.9")):
        assert lines[(stage, "none")].split()[2] == gb
    assert "activations are not included" in out and "GB = 1e9 bytes" in out
    assert "per GPU = after the backward" in out and "between steps" in out
    code, out, err = run(estimate_cmd.app, ["--params", "7.5B", "--gpus_per_node", "8", "--nodes", "8", "--json"], capsys)
    doc = json.loads(out)
    gpu = {(r["stage"], r["offload"]): r["per_gpu_bytes"] for r in doc["rows"]}
    assert gpu[(0, "none")] == 120e9 and gpu[(3, "none")] == pytest.approx(16 * 7.5e9 / 64)
    host = {(r["stage"], r["offload"]): r["per_host_bytes"] for r in doc["rows"]}
    # offloaded: the paper's 16Ψ/N moves to the host, plus the CPU optimizer's fp32 gradient copy
    assert host[(3, "optimizer+params")] == pytest.approx((16 + 2) * 7.5e9 / 64 * 8)
    # the point in the step: after the backward; between steps the GPU gradients are freed
    assert "after the backward" in doc["point"]
    between = {(r["stage"], r["offload"]): r["per_gpu_between_steps_bytes"] for r in doc["rows"]}
    assert between[(3, "none")] == pytest.approx(14 * 7.5e9 / 64)


def test_estimate_follows_a_config(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text("bf16: {enabled: true}\noptimizer: {type: SGD, params: {lr: 0.1}}\nzero_optimization: {stage: 2}\n")
    code, out, err = run(estimate_cmd.app, ["--params", "1e9", "--gpus-per-node", "4", "--config", str(p), "--units", "GiB"], capsys)
    assert code == 0, err
    assert "◀ your config" in out and "SGD" in out and "GiB = 2^30 bytes" in out
    code, out, err = run(estimate_cmd.app, ["--params", "1e9", "--config", str(p), "--json"], capsys)
    doc = json.loads(out)
    assert doc["bytes_per_element"] == {"params": 2, "grads": 4, "master": 4, "optimizer_states": 0}
    code, out, err = run(estimate_cmd.app, ["--params", "1e9", "--config", str(tmp_path / "missing.json")], capsys)
    assert code == 1 and "no such config file" in flat(err)


def test_real_entry_point_without_torch():
    # The console entry as users call it, and proof that loading configs, print-config,
    # estimate and importing env never import torch (the launcher validates before ranks start).
    code = (
        "import sys\n"
        "from zerorun.cli import main\n"
        "try:\n    main(['print-config', 'templates/zero2.yaml', '--world-size', '8'])\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "try:\n    main(['estimate', '--params', '7.5e9', '--gpus-per-node', '8', '--nodes', '8'])\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "import zerorun.cli.env_cmd\n"
        "from zerorun.config import load_config\n"
        "load_config('tests/config/data/deepspeed_all_keys.json', world_size=2)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "valid: 0 warnings, 0 notices" in done.stdout and "120.0" in done.stdout
