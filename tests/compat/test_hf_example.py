"""examples/hf_trainer.py (run_clm-style, `--deepspeed`) through `zerorun --deepspeed-compat`:
ZeRO-3 with CPU optimizer offload on one CPU rank trains, saves, and a second run resumes from
the last checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ._run import launch

CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def _train(cfg: Path, out: Path, max_steps: int) -> dict:
    launch(
        ["--num_gpus", "1", "--device", "cpu", "examples/hf_trainer.py", "--deepspeed", str(cfg),
         "--output_dir", str(out), "--max_steps", str(max_steps), "--save_steps", "4",
         "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--learning_rate", "3e-3",
         "--logging_steps", "2", "--report_to", "none", "--disable_tqdm", "true", "--do_eval"],
        timeout=240,
    )
    return json.loads((out / "metrics.json").read_text())


def test_hf_trainer_example_trains_saves_and_resumes(tmp_path: Path) -> None:
    cfg, out = tmp_path / "ds_config.json", tmp_path / "out"
    cfg.write_text(json.dumps(CONFIG))
    first = _train(cfg, out, max_steps=4)
    assert first["resumed_from"] is None
    # Byte tokens: an untrained model is near ln(256) = 5.55; a few steps on text go well below.
    assert first["eval_loss"] < math.log(256) - 0.3
    assert (out / "checkpoint-4" / "latest").read_text().strip() == "global_step4"
    assert (out / "model.safetensors").is_file()
    second = _train(cfg, out, max_steps=6)
    assert second["resumed_from"] == str(out / "checkpoint-4")
    steps = [h["step"] for h in second["log_history"] if "loss" in h]
    assert steps == [2, 4, 6]  # the first two come from the checkpoint's trainer state
    assert second["eval_loss"] < first["eval_loss"]
