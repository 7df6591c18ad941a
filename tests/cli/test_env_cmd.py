"""zerorun env: the bug-report facts, as text and as JSON."""

from __future__ import annotations

import json

import pytest

from zerorun.cli import env_cmd


def test_env_reports_versions_shm_and_nccl_variables(capsys, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("UNRELATED_SECRET", "x")
    monkeypatch.setenv("TORCH_HUB_TOKEN", "hf_not_for_bug_reports")
    with pytest.raises(SystemExit) as info:
        env_cmd.app(["--json"], prog_name="zerorun env")
    assert not info.value.code
    doc = json.loads(capsys.readouterr().out)
    import torch

    assert doc["torch"] == torch.__version__ and doc["cuda_available"] == torch.cuda.is_available()
    assert doc["zerorun"] and doc["python"].count(".") == 2
    assert doc["dev_shm"]["total_bytes"] > 0 and doc["host"]["cpus"] >= 1
    assert doc["environment"]["NCCL_DEBUG"] == "INFO" and "UNRELATED_SECRET" not in doc["environment"]
    # shown so the user sees it is set, never its value: this output is pasted into bug reports
    assert doc["environment"]["TORCH_HUB_TOKEN"] != "hf_not_for_bug_reports"
    assert "gloo" in doc["distributed_backends"]
    assert "memlock_limit_bytes" in doc and "nvidia_driver" in doc

    with pytest.raises(SystemExit):
        env_cmd.app([], prog_name="zerorun env")
    out = capsys.readouterr().out
    for needle in ("zerorun", "torch", "/dev/shm", "NCCL_DEBUG=INFO", "GPUs", "ulimit -l", "TORCH_HUB_TOKEN="):
        assert needle in out
    assert "hf_not_for_bug_reports" not in out
