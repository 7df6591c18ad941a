"""ZeRO-3 ``from_pretrained`` with ``HfDeepSpeedConfig`` (no Trainer), every rank.

    zerorun --deepspeed-compat --num_gpus 2 tests/compat/_zero3_load_worker.py --model DIR --out DIR

The script is a plain DeepSpeed + transformers script. It records, per rank: whether every
parameter came out of ``from_pretrained`` partitioned, how many elements this rank holds, the
largest difference between the gathered weights and the checkpoint file, and, after
``deepspeed.initialize``, the difference between the engine's logits and those of the model
loaded without DeepSpeed.
"""

from __future__ import annotations

import argparse
import json
import os

import deepspeed
import torch
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel
from transformers.integrations import HfDeepSpeedConfig
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--model", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()

deepspeed.init_distributed()
rank = deepspeed.comm.get_rank()
config = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}
keep_alive = HfDeepSpeedConfig(config)  # must live while from_pretrained runs
model = GPT2LMHeadModel.from_pretrained(args.model)
params = list(model.named_parameters())
partitioned = all(hasattr(p, "ds_numel") for _, p in params)
held = sum(p._zerorun_init.shard.numel() for _, p in params if hasattr(p, "_zerorun_init"))
total = sum(p.ds_numel for _, p in params)
# Under the layer (as with DeepSpeed) state_dict() holds placeholders: one shared element each.
names = {name for name, _ in params}
placeholders = all(v.untyped_storage().nbytes() <= v.element_size() for k, v in model.state_dict().items() if k in names)

reference = load_file(os.path.join(args.model, "model.safetensors"))
diffs = {}
for name, p in params:
    with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
        key = name if name in reference else name.removeprefix("transformer.")
        if key in reference:
            diffs[name] = (p.detach().float() - reference[key].float()).abs().max().item()

engine, *_ = deepspeed.initialize(model=model, config=config)
# What Trainer.save_model gets at ZeRO-3: the full weights on rank 0, nothing elsewhere.
consolidated = engine._zero3_consolidated_16bit_state_dict()
if consolidated is None:
    consolidated_diff = None
else:
    ref_key = {k: k if k in reference else k.removeprefix("transformer.") for k in consolidated}
    consolidated_diff = max(
        (consolidated[k].float() - reference[ref_key[k]].float()).abs().max().item()
        for k in consolidated
        if ref_key[k] in reference
    )
    consolidated_keys = sorted(consolidated) == sorted(model.state_dict())
torch.manual_seed(0)
ids = torch.randint(0, 128, (2, 16))
engine.eval()
with torch.no_grad():
    logits = engine(input_ids=ids).logits
# The reference model is loaded without DeepSpeed: the config object must be gone first.
del keep_alive
unset_hf_deepspeed_config()
plain = GPT2LMHeadModel.from_pretrained(args.model).eval()
with torch.no_grad():
    expected = plain(input_ids=ids).logits
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
    json.dump(
        {
            "rank": rank,
            "world": deepspeed.comm.get_world_size(),
            "local_rank_arg": args.local_rank,
            "partitioned": partitioned,
            "placeholder_state_dict": placeholders,
            "held": held,
            "total": total,
            "max_weight_diff": max(diffs.values()),
            "compared": len(diffs),
            "num_params": len(params),
            "logits_diff": (logits.float() - expected.float()).abs().max().item(),
            "consolidated_diff": consolidated_diff,
            "consolidated_keys": consolidated_keys if consolidated is not None else None,
        },
        fh,
    )
