"""Crash-safety primitives, tag resolution, and the messages users get for mistakes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from zerorun.errors import CheckpointError
from zerorun.runtime.checkpoint import atomic
from zerorun.runtime.checkpoint.format import ParamInfo
from zerorun.runtime.checkpoint.sharded import _check_compatible, _check_tag, _Comm, resolve_tag

from ._layout import meta_for, model_state


def test_commit_replaces_an_existing_tag_and_latest_is_atomic(tmp_path):
    old = tmp_path / "global_step1"
    old.mkdir()
    (old / "f").write_text("old")
    new = atomic.tmp_dir_for(tmp_path, "global_step1")
    new.mkdir()
    (new / "f").write_text("new")
    atomic.commit_dir(new, old)
    assert (old / "f").read_text() == "new"
    assert atomic.stale_tmp_dirs(tmp_path) == []  # the replaced checkpoint is gone too
    atomic.write_latest(tmp_path, "global_step1")
    assert atomic.read_latest(tmp_path) == "global_step1"
    assert sorted(os.listdir(tmp_path)) == ["global_step1", "latest"]


def test_stale_tmp_dirs_are_ignored_by_lookups_and_removed(tmp_path, caplog):
    (tmp_path / "global_step2").mkdir()
    (tmp_path / ".tmp-global_step3").mkdir()
    atomic.write_latest(tmp_path, "global_step2")
    with caplog.at_level(logging.WARNING, logger="zerorun.checkpoint"):
        assert resolve_tag(tmp_path, None) == "global_step2"
    assert "ignoring .tmp-global_step3" in caplog.text
    with pytest.raises(CheckpointError, match="incomplete save"):
        resolve_tag(tmp_path, ".tmp-global_step3")
    assert [p.name for p in atomic.remove_stale_tmp_dirs(tmp_path)] == [".tmp-global_step3"]
    assert atomic.stale_tmp_dirs(tmp_path) == []


def test_resolve_tag_messages(tmp_path):
    assert resolve_tag(tmp_path, None) is None  # nothing saved yet: DeepSpeed's (None, None)
    (tmp_path / "global_step5").mkdir()
    with pytest.raises(CheckpointError, match=r"no checkpoint 'global_step9' .*available: global_step5"):
        resolve_tag(tmp_path, "global_step9")
    atomic.write_latest(tmp_path, "global_step7")
    with pytest.raises(CheckpointError, match="names tag 'global_step7' but"):
        resolve_tag(tmp_path, None)
    for bad in ("a/b", ".hidden", "latest", ""):
        with pytest.raises(CheckpointError, match="invalid checkpoint tag"):
            _check_tag(bad)


def test_crash_injection_kills_only_the_named_rank_at_the_named_point(monkeypatch):
    code = "from zerorun.runtime.checkpoint.atomic import maybe_crash as m; m(0, 'mid_shard'); m(1, 'before_commit'); print('alive')"
    env = dict(os.environ, ZERORUN_CHECKPOINT_CRASH="1:before_commit")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == -9 and "alive" not in out.stdout
    monkeypatch.setenv("ZERORUN_CHECKPOINT_CRASH", "0:somewhere")
    with pytest.raises(CheckpointError, match="point must be one of"):
        atomic.maybe_crash(0, "mid_shard")


def test_incompatible_model_or_optimizer_is_a_clear_error(tmp_path):
    state = model_state({"a.weight": (4, 3), "b.bias": (5,)})
    saved = meta_for(state, world_size=2, stage=2)
    other = meta_for(state, world_size=1, stage=0)
    _check_compatible(saved, other, tmp_path, True)  # another world size/stage: fine
    other.params[0] = ParamInfo("a.weight", (3, 4), "float32")
    with pytest.raises(CheckpointError, match=r"'a.weight' has shape \[4, 3\] in the checkpoint, \[3, 4\] in the model"):
        _check_compatible(saved, other, tmp_path, True)
    other = meta_for(state, world_size=1, stage=0)
    other.params.append(ParamInfo("c.weight", (2,), "float32"))
    with pytest.raises(CheckpointError, match="parameters the checkpoint lacks: \\['c.weight'\\]"):
        _check_compatible(saved, other, tmp_path, True)
    other = meta_for(state, world_size=1, stage=0)
    other.optimizer = {"class": "SGD"}
    with pytest.raises(CheckpointError, match="saved with optimizer AdamW, the engine uses SGD; pass load_optimizer_states=False"):
        _check_compatible(saved, other, tmp_path, True)
    _check_compatible(saved, other, tmp_path, False)


def test_deepspeed_checkpoint_is_named_as_such(tmp_path):
    from zerorun.runtime.checkpoint.store import CheckpointReader

    tag = tmp_path / "global_step10"
    tag.mkdir()
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a DeepSpeed checkpoint, not a zerorun one: convert it with DeepSpeed's zero_to_fp32.py"):
        CheckpointReader(tag)


def test_save_16bit_model_at_stage3_needs_the_gather_flag(tmp_path, caplog):
    """DeepSpeed's rule: without stage3_gather_16bit_weights_on_model_save nothing is written,
    the call says why and returns False (decided before any collective or engine access)."""
    from types import SimpleNamespace

    from zerorun.config import load_config
    from zerorun.runtime.checkpoint.engine_view import save_16bit_model
    from zerorun.runtime.settings import settings_from_config

    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}).config
    engine = SimpleNamespace(settings=settings_from_config(cfg, world_size=1))
    with caplog.at_level(logging.WARNING, logger="zerorun.checkpoint"):
        assert save_16bit_model(engine, tmp_path, "pytorch_model.bin") is False
    assert "stage3_gather_16bit_weights_on_model_save: true" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_a_tag_left_only_under_its_replaced_name_is_put_back(tmp_path):
    """Re-saving a tag without an atomic exchange renames the old copy to `.tmp-old-TAG` first;
    a crash before the new copy lands leaves only that: load and the next save restore it
    instead of treating it as a stale leftover."""
    old = tmp_path / f"{atomic.TMP_PREFIX}old-global_step4"
    old.mkdir()
    (old / "rank0.safetensors").write_bytes(b"complete")
    (tmp_path / f"{atomic.TMP_PREFIX}global_step4").mkdir()  # the new copy, half written
    atomic.write_latest(tmp_path, "global_step4")
    assert resolve_tag(tmp_path, None) == "global_step4"
    assert (tmp_path / "global_step4" / "rank0.safetensors").read_bytes() == b"complete"
    removed = atomic.remove_stale_tmp_dirs(tmp_path)
    assert [p.name for p in removed] == [f"{atomic.TMP_PREFIX}global_step4"]
    assert (tmp_path / "global_step4").is_dir()


def test_a_save_phase_fails_on_every_rank_with_the_ranks_messages_or_the_lost_rank(monkeypatch):
    comm = _Comm(SimpleNamespace(rank=0, world_size=1, process_group=None))
    comm.agree(None, "checkpoint save to d failed", "before its files were written", "latest untouched")
    with pytest.raises(CheckpointError, match=r"^checkpoint save to d failed: rank 0: disk full; latest untouched$"):
        comm.agree("rank 0: disk full", "checkpoint save to d failed", "before its files were written", "latest untouched")

    def lost(obj):
        raise RuntimeError("connection closed by peer")

    monkeypatch.setattr(comm, "all_gather_object", lost)
    with pytest.raises(CheckpointError, match=r"a rank stopped while adding its files \(connection closed by peer\)"):
        comm.agree(None, "checkpoint save to d failed", "while adding its files", "latest untouched")
