"""A small run_clm-style Hugging Face Trainer script: causal LM training with `--deepspeed`.

The article's section 3.3 command, with zerorun instead of deepspeed and nothing else changed:

    deepspeed --num_gpus 2 examples/hf_trainer.py --deepspeed ds_config.json --output_dir out ...
    zerorun --deepspeed-compat --num_gpus 2 examples/hf_trainer.py --deepspeed ds_config.json --output_dir out ...

Nothing is downloaded: without `--model_name_or_path` a tiny GPT-2 is built from a config
(`AutoModelForCausalLM.from_config`, partitioned by zero.Init under ZeRO-3), and the data are
the bytes of `--train_file` (default: this script) as tokens (vocabulary 256), cut in blocks of
`--block_size`; the last tenth is the evaluation set. It trains (resuming from the last
`checkpoint-*` in `--output_dir` if there is one), saves the final model there, evaluates with
`--do_eval`, and writes metrics.json.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "a local model directory"})
    n_layer: int = field(default=2, metadata={"help": "layers of the tiny GPT-2 (without a model path)"})
    n_embd: int = field(default=64, metadata={"help": "width of the tiny GPT-2"})
    n_head: int = field(default=2)
    dropout: float = field(default=0.1, metadata={"help": "GPT-2's dropout rates (0: runs comparable across world sizes)"})


@dataclass
class DataArguments:
    train_file: str = field(default=__file__, metadata={"help": "any text file; its bytes are the tokens"})
    block_size: int = field(default=32)


class ByteBlocks(Dataset):
    def __init__(self, data: bytes, block_size: int) -> None:
        ids = torch.tensor(list(data), dtype=torch.long)
        n = len(ids) // block_size
        self.blocks = ids[: n * block_size].view(n, block_size)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    set_seed(training_args.seed)

    # After TrainingArguments (which holds the DeepSpeed config): under ZeRO-3 the model is
    # partitioned while it is built or loaded.
    if model_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    else:
        config = AutoConfig.for_model(
            "gpt2",
            vocab_size=256,
            n_positions=max(64, data_args.block_size),
            n_layer=model_args.n_layer,
            n_embd=model_args.n_embd,
            n_head=model_args.n_head,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=model_args.dropout,
            embd_pdrop=model_args.dropout,
            attn_pdrop=model_args.dropout,
        )
        model = AutoModelForCausalLM.from_config(config)

    data = Path(data_args.train_file).read_bytes()
    cut = len(data) * 9 // 10
    train, evaluation = ByteBlocks(data[:cut], data_args.block_size), ByteBlocks(data[cut:], data_args.block_size)
    trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=evaluation)

    last = None
    if os.path.isdir(training_args.output_dir):
        last = get_last_checkpoint(training_args.output_dir)
    result = trainer.train(resume_from_checkpoint=last)
    trainer.save_model()
    metrics = {"train_loss": result.training_loss, "resumed_from": last}
    if training_args.do_eval:
        metrics.update(trainer.evaluate())
    if trainer.is_world_process_zero():
        print(json.dumps(metrics))
        with open(os.path.join(training_args.output_dir, "metrics.json"), "w") as fh:
            json.dump({**metrics, "log_history": trainer.state.log_history}, fh)


if __name__ == "__main__":
    main()
