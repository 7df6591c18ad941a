"""The training recipe every configuration shares: model, data, AdamW hyperparameters.

The model and the data generator come from `examples/gpt_model.py` (torch only), so the
benchmark trains exactly the README's example model.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

import torch

_EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import gpt_model  # noqa: E402

__all__ = ["LR", "BETAS", "EPS", "WEIGHT_DECAY", "gpt_model", "build_model", "adamw"]

# AdamW lr 1e-4 (the benchmark issue's recipe); betas/eps/decay are the usual GPT values and
# are passed identically to torch (peers) and to zerorun's config.
LR = 1e-4
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.01


def build_model(cfg: gpt_model.GPTConfig, device: torch.device, seed: int) -> gpt_model.GPT:
    """The model in fp32, built directly on `device` from `seed`: identical initial weights
    for every configuration on the same kind of device."""
    torch.manual_seed(seed)
    with torch.device(device):
        return gpt_model.GPT(cfg)


def adamw(params: Iterable[torch.nn.Parameter], device: torch.device) -> torch.optim.Optimizer:
    """torch AdamW with the recipe's hyperparameters, fused kernel (CUDA and CPU have one)."""
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
