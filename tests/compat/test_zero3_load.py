"""ZeRO-3 `from_pretrained` with `HfDeepSpeedConfig` on 2 CPU ranks (no Trainer): each rank
holds half of the model after loading, every rank's gathered weights equal the checkpoint,
and the engine built on the partitioned model computes the checkpoint's logits."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from ._run import launch, run

MAKE_MODEL = textwrap.dedent(
    """
    import sys, torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    GPT2LMHeadModel(cfg).save_pretrained(sys.argv[1])
    """
)


def test_zero3_from_pretrained_on_two_ranks(tmp_path: Path) -> None:
    model_dir, out = tmp_path / "tiny-gpt2", tmp_path / "out"
    out.mkdir()
    run(["-c", MAKE_MODEL, str(model_dir)], timeout=120)
    launch(
        ["--num_gpus", "2", "--device", "cpu", "tests/compat/_zero3_load_worker.py", "--model", str(model_dir),
         "--out", str(out)],
        timeout=300,
    )
    for rank in (0, 1):
        got = json.loads((out / f"rank{rank}.json").read_text())
        assert got["world"] == 2 and got["local_rank_arg"] == rank
        assert got["partitioned"] is True and got["placeholder_state_dict"] is True
        assert got["held"] <= got["total"] // 2 + got["num_params"]  # ceil(numel / 2) per parameter
        assert got["compared"] == got["num_params"]
        assert got["max_weight_diff"] == 0.0
        assert got["logits_diff"] < 1e-5
        if rank == 0:  # Trainer.save_model's state dict at ZeRO-3: whole, exact, on rank 0 only
            assert got["consolidated_diff"] == 0.0 and got["consolidated_keys"] is True
        else:
            assert got["consolidated_diff"] is None
