"""Random stand-ins for the hub models the peer suites load (no network here).

Each is the model's architecture (the class ``from_pretrained`` builds) with small dimensions
and random weights, written into a Hugging Face hub cache (``HF_HUB_CACHE``) exactly where a
download would put it, so ``from_pretrained("sshleifer/tiny-gpt2")`` with ``HF_HUB_OFFLINE=1``
finds it. Tokenizers are not provided (the one test that needs the T5 sentencepiece tokenizer is
deselected, see gates.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["STANDINS", "write_standins"]

_REVISION = "0" * 40


def _gpt2_tiny() -> Any:  # sshleifer/tiny-gpt2's own dimensions
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=2, n_head=2, n_layer=2, n_positions=1024, vocab_size=50257))


def _gpt2_random() -> Any:  # hf-internal-testing/tiny-random-gpt2
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_head=4, n_layer=2, n_positions=512, vocab_size=1000,
                                      bos_token_id=0, eos_token_id=0))


def _gpt2() -> Any:  # "gpt2" (124M): its architecture, small
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_head=4, n_layer=2, n_positions=1024, vocab_size=50257))


def _t5_tiny() -> Any:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=32100, d_model=64, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5ForConditionalGeneration(cfg)


def _gptj_tiny() -> Any:
    from transformers import GPTJConfig, GPTJForCausalLM

    return GPTJForCausalLM(GPTJConfig(vocab_size=1000, n_positions=512, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                      bos_token_id=0, eos_token_id=0))


def _qwen_moe_tiny() -> Any:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(vocab_size=1000, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                         shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=512)
    return Qwen2MoeForCausalLM(cfg)


def _mobilevit_config() -> Any:  # the suites read only its config (hidden_sizes)
    from transformers import MobileViTConfig

    return MobileViTConfig(hidden_sizes=[64, 80, 96], neck_hidden_sizes=[16, 16, 24, 48, 64, 80, 320])


STANDINS: dict[str, Callable[[], Any]] = {
    "sshleifer/tiny-gpt2": _gpt2_tiny,
    "hf-internal-testing/tiny-random-gpt2": _gpt2_random,
    "gpt2": _gpt2,
    "openai-community/gpt2": _gpt2,
    "patrickvonplaten/t5-tiny-random": _t5_tiny,
    "hf-internal-testing/tiny-random-gptj": _gptj_tiny,
    "peft-internal-testing/tiny-random-qwen-1.5-MoE": _qwen_moe_tiny,
    "apple/mobilevit-xx-small": _mobilevit_config,
}


def write_standins(hub_cache: Path) -> list[str]:
    """Write every stand-in into ``hub_cache`` (a ``HF_HUB_CACHE`` directory); returns the repo ids."""
    import torch

    for repo, make in STANDINS.items():
        folder = hub_cache / ("models--" + repo.replace("/", "--"))
        snapshot = folder / "snapshots" / _REVISION
        if (snapshot / "config.json").is_file():
            continue
        torch.manual_seed(0)
        obj = make()
        if hasattr(obj, "save_pretrained") and hasattr(obj, "config"):
            obj.save_pretrained(snapshot, safe_serialization=True)
        else:
            obj.save_pretrained(snapshot)
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / "main").write_text(_REVISION)
        (snapshot / "generation_config.json").unlink(missing_ok=True)
    (hub_cache / "zerorun-standins.json").write_text(json.dumps(sorted(STANDINS), indent=1))
    return sorted(STANDINS)
