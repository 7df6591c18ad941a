"""The job that _ft_worker.py runs in the launcher-level fault-tolerance tests
(tests/launch/test_restart.py, tests/compat/test_initialize_checkpoints.py): its config (FT_CONFIG)
and the losses it logged. Import as ``runtime.checkpoint._ft_job`` (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import json
from pathlib import Path


def ft_config(ckpt: Path) -> dict:
    """Stage 2 on 2 ranks, AdamW + WarmupLR, auto-resume from ``ckpt``, saves every 2 steps."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 150},
        "steps_per_print": 1000,
        "zerorun": {"checkpoint": {"dir": str(ckpt), "auto_resume": True, "every_n_steps": 2}},
    }


def ft_losses(out: Path) -> dict[int, float]:
    """Step -> loss of the last run that logged it (a replayed step overwrites)."""
    rows = [json.loads(x) for x in (out / "losses_rank0.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}
