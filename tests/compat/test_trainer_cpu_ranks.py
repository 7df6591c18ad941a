"""Hugging Face Trainer on 2 CPU ranks under `zerorun --deepspeed-compat --device cpu`, as on
GPUs: accelerate counts both processes (compat/accelerate_cpu.py), each rank trains on its half
of every global batch, and the run equals one rank with the whole global batch -- per-step
losses, eval loss and the saved weights (examples/hf_trainer.py, ZeRO-2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ._run import launch

# SGD, not Adam: Adam turns rounding noise in near-zero gradients (GPT-2's attention key bias has
# an exactly-zero true gradient) into full-size steps, so the weights of two reduction orders
# would differ by ~lr; with SGD they differ by rounding.

CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2},
}


def _train(cfg: Path, text: Path, out: Path, ranks: int) -> dict:
    # 200 blocks of 32 bytes: 180 to train, 20 to evaluate, one evaluation batch per rank (no
    # padding of a short last batch, which would weigh samples differently).
    launch(
        ["--num_gpus", str(ranks), "--device", "cpu", "examples/hf_trainer.py", "--deepspeed", str(cfg),
         "--train_file", str(text), "--block_size", "32",
         "--output_dir", str(out), "--max_steps", "4", "--save_strategy", "no", "--seed", "0",
         "--per_device_train_batch_size", str(4 // ranks), "--per_device_eval_batch_size", str(20 // ranks),
         "--optim", "sgd", "--learning_rate", "0.5", "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true",
         "--dropout", "0", "--do_eval"],  # no dropout: random masks depend on how samples are spread
        timeout=300,
    )
    return json.loads((out / "metrics.json").read_text())


def test_two_cpu_ranks_train_like_one_rank_with_the_whole_batch(tmp_path: Path) -> None:
    cfg, text = tmp_path / "ds_config.json", tmp_path / "text.txt"
    cfg.write_text(json.dumps(CONFIG))
    words = " ".join(f"word{i % 97}" for i in range(2000)).encode()
    text.write_bytes(words[: 32 * 200])
    two, one = _train(cfg, text, tmp_path / "two", 2), _train(cfg, text, tmp_path / "one", 1)
    losses = {n: [h["loss"] for h in r["log_history"] if "loss" in h] for n, r in (("two", two), ("one", one))}
    assert len(losses["two"]) == 4
    assert losses["two"] == pytest.approx(losses["one"], rel=1e-5)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "two" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
    assert two["eval_loss"] < losses["two"][0]  # it learned
