"""The engine's own checkpoints (runtime/checkpoint/autosave.py, async_save.py): periodic
asynchronous saves, a rank killed in the middle of a background write, and the automatic resume
that continues where the last complete save stopped. Real gloo ranks; one crashing job and its
resumption share every assertion."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from _ranks import run_ranks

from zerorun.runtime.checkpoint import CheckpointReader, get_fp32_state_dict

WORKER = "tests/runtime/checkpoint/_ft_worker.py"


def _config(ckpt: Path, **checkpoint: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 200},
        "steps_per_print": 1000,
        "zerorun": {"checkpoint": {"dir": str(ckpt), **checkpoint}},
    }


def _losses(out: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (out / f"losses_rank{rank}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def crashed_then_resumed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run 1: 2 ranks, stage 2, async saves every 2 steps (keep_last 1), a synchronous save of
    step 4 by the script beside the engine's asynchronous one; rank 1 SIGKILLs itself in the
    middle of writing its shard of step 6's save. Run 2: the same script and config (auto_resume)
    continues from what run 1 left and trains to step 8."""
    out = tmp_path_factory.mktemp("ft")
    ckpt = out / "auto"
    cfg = _config(ckpt, auto_resume=True, every_n_steps=2, keep_last=1, **{"async": True})
    env = {"FT_CONFIG": json.dumps(cfg), "FT_OUT": str(out), "FT_STEPS": "8"}
    first = run_ranks(
        [WORKER], 2, deadline_s=150, fail_fast=False,
        extra_env={**env, "FT_SYNC_SAVE_AT": "4", "FT_CRASH_AFTER": "4", "FT_CRASH": "1:mid_shard"},
    )
    kept = out / "after_crash"  # run 2's saves replace these (keep_last 1)
    shutil.copytree(ckpt, kept)
    after_crash = {"dir": kept, "entries": sorted(p.name for p in ckpt.iterdir()), "losses": _losses(out)}
    # Run 2 ends with dist.destroy_process_group() right after its last step, whose
    # asynchronous save is then still writing (no final save, no engine.destroy()).
    second = run_ranks([WORKER], 2, deadline_s=150, extra_env={**env, "FT_NO_FINAL": "1"})
    return {"out": out, "ckpt": ckpt, "first": first, "second": second, "after_crash": after_crash}


def test_kill_during_background_write_keeps_previous_latest(crashed_then_resumed: dict) -> None:
    first = crashed_then_resumed["first"]
    assert first[1][0] == -9, first[1][1][-3000:]  # rank 1 died in the writer thread
    assert first[0][0] != 0  # rank 0 lost its peer
    after = crashed_then_resumed["after_crash"]
    # The save of step 6 never committed: `latest` still names step 4, whose files are all
    # there; keep_last 1 removed step 2 once step 4 was committed; the half-written save is
    # only a temporary directory (the next save removes it).
    assert (after["dir"] / "latest").read_text() == "global_step4"
    assert after["entries"] == [".tmp-global_step6", "global_step4", "latest"]
    with CheckpointReader(after["dir"] / "global_step4") as reader:
        assert reader.meta.counters["global_steps"] == 4
        assert reader.meta.extra["data_position"] == {"epoch": 0, "samples": 16}
    assert set(get_fp32_state_dict(after["dir"])) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_async_save_is_bit_identical_to_a_sync_save(crashed_then_resumed: dict) -> None:
    # The engine's asynchronous save of step 4 (snapshot in host buffers, written by the
    # background thread over its own gloo group) and the script's synchronous one of the same step.
    out = crashed_then_resumed["out"]
    a, b = out / "sync" / "global_step4", crashed_then_resumed["after_crash"]["dir"] / "global_step4"
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert len(names) == 6  # metadata, engine state, 2 shards, 2 RNG files
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_auto_resume_continues_with_identical_losses(crashed_then_resumed: dict) -> None:
    second = crashed_then_resumed["second"]
    assert [rc for rc, _ in second] == [0, 0], second[0][1][-3000:]
    assert "resumed from" in second[0][1] and "global_step4 at step 4" in second[0][1]
    losses = _losses(crashed_then_resumed["out"])
    before = {e["step"]: e["loss"] for e in crashed_then_resumed["after_crash"]["losses"]}
    resumed = [e for e in losses if e["resumed_from"]]
    assert [e["step"] for e in resumed] == [5, 6, 7, 8]
    assert resumed[0]["resumed_from"].endswith("global_step4")
    # Steps 5 (and 6, when run 1 logged it before dying) again, with the same data and state.
    again = [e for e in resumed if e["step"] in before]
    assert again and all(e["loss"] == before[e["step"]] for e in again)
    ckpt = crashed_then_resumed["ckpt"]
    # destroy_process_group waited for the save of step 8 to commit
    assert (ckpt / "latest").read_text() == "global_step8"
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step8", "latest"]
    assert not os.path.exists(ckpt / ".tmp-global_step6")


def test_async_save_is_bit_identical_at_stage3_with_nvme_and_cpu_offload(tmp_path: Path) -> None:
    """The snapshot reads what a synchronous save reads at every stage and placement: here the
    file-mapped NVMe masters and Adam states and the CPU parameter slices of stage 3."""
    (tmp_path / "nvme").mkdir()
    cfg = _config(tmp_path / "auto", every_n_steps=2, **{"async": True})
    cfg["zero_optimization"] = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")},
        "offload_param": {"device": "cpu"},
    }
    env = {"FT_CONFIG": json.dumps(cfg), "FT_OUT": str(tmp_path), "FT_STEPS": "3", "FT_SYNC_SAVE_AT": "2"}
    results = run_ranks([WORKER], 2, deadline_s=150, extra_env=env)
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:]
    a, b = tmp_path / "sync" / "global_step2", tmp_path / "auto" / "global_step2"
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and len(names) == 6
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
