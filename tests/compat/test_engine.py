"""The engine adapter's gradient-accumulation protocols (accelerate's announced boundaries with
short windows, DeepSpeed scripts' backward+step, no_sync) at stages 0-3 equal plain PyTorch
exactly; what it refuses, it refuses with the name. One process, world 1 (_engine_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

from ._run import run


def test_accumulation_protocols_and_refusals(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    run(["tests/compat/_engine_worker.py", str(out)], timeout=240, CUDA_VISIBLE_DEVICES="")  # CPU reference
    got = json.loads(out.read_text())
    refusals = got.pop("refusals")
    assert set(got) == {f"explicit_s{s}" for s in range(4)} | {"script_s1", "script_s3", "no_sync_s1"}
    for case, diff in got.items():
        assert diff < 1e-6, case
    assert "incompatible with gradient partitioning (ZeRO stage 2)" in refusals["no_sync_stage2"]
    assert "deepspeed.DeepSpeedEngine.pipeline_parallelism_world_size is not provided" in refusals["missing_attr"]
    assert refusals["hasattr"] == "False"
    assert refusals["eval_optimizer"] == "None"  # DeepSpeed returns no optimizer without one
    assert "initialized without an optimizer (evaluation only)" in refusals["eval_backward"]
