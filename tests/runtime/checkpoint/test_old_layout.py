"""A stage-3 checkpoint written before parameters were 16-byte aligned in their flat buffers
(1558da7) loads into today's layout: the committed fixture (fixtures/stage3_pre_align, written by
_old_layout_worker.py at e1e5b60, the commit before) has parameters packed back to back; today
every one after the first moves. Loaded at the same world size, the fp32 masters equal the ones
saved, and the next steps' losses and masters equal what the old code computed after its save
(bit for bit: optimizer states and step count came back too). At one rank (resharded) the
masters equal the saved ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ._spawn import spawn

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "stage3_pre_align"
WORKER = HERE / "_old_layout_worker.py"


def _load(world: int, tmp_path: Path) -> dict:
    out = tmp_path / f"check{world}.json"
    results = spawn(world, [str(WORKER), "check", str(FIXTURE), str(out)], timeout=180, log_dir=tmp_path)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.output[-4000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def expected() -> dict:
    return json.loads((FIXTURE / "expected.json").read_text())


def test_fixture_has_the_old_packing(expected: dict) -> None:
    old = expected["slot_offsets"]
    assert old["head.weight"] == 65 and old["blocks.0.fc1.bias"] == 35  # back to back, unaligned


def test_pre_align_checkpoint_resumes_bit_for_bit(expected: dict, tmp_path: Path) -> None:
    got = _load(2, tmp_path)
    assert got["slot_offsets"] != expected["slot_offsets"], "the layout did not change: the fixture tests nothing"
    assert got["slot_offsets"]["head.weight"] % 8 == 0  # bf16: 16 bytes = 8 elements
    assert got["masters_at_load"] == expected["masters_at_save"]
    assert got["global_steps"] == 2 + len(expected["losses_after"])
    assert got["losses_after"] == expected["losses_after"]
    assert got["masters_after"] == expected["masters_after"]


def test_pre_align_checkpoint_loads_at_another_world_size(expected: dict, tmp_path: Path) -> None:
    got = _load(1, tmp_path)
    assert got["masters_at_load"] == expected["masters_at_save"]
