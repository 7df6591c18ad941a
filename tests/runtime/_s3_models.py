"""The stage-3 test model and the stage-3 workers' call of the one single-process reference
trainer (_reference.py).

S3Net has what stage 3 finds hard: repeated blocks (>= 3 partitioned groups with the test's
persistence threshold), the embedding tied to the head (root group), a weight tied between two
blocks (two groups -> root group), a block called twice in one forward, a data-dependent branch
that swaps two blocks between steps (same on every rank within a step), activation
checkpointing around one block (non-reentrant, or reentrant when asked) and inside another, a
frozen layer, a never-used layer, and sizes not divisible by 4.
"""

from __future__ import annotations

import math

import _reference as _ref  # tests/runtime is the workers' script folder (not a package import)
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, HID, SEQ = 13, 10, 30, 5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)  # persistent (small)
        self.fc1 = nn.Linear(DIM, HID)
        self.fc2 = nn.Linear(HID, DIM)

        self.inner_checkpoint = False  # activation checkpointing *inside* the group's forward

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inner_checkpoint:
            return x + checkpoint(self._mlp, x, use_reentrant=False)
        return x + self._mlp(x)


class S3Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.blocks[2].inner_checkpoint = True
        self.blocks[3].fc1.weight = self.blocks[0].fc1.weight  # tied across two groups
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.never = nn.Linear(DIM, 3)  # never used
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied (root group)
        self.flip = False  # the data-dependent branch; the test sets it per step, same on all ranks
        self.reentrant = False  # torch.utils.checkpoint's reentrant variant (same numerics)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = self.blocks[0](h)
        h = self.blocks[1](self.blocks[1](h))  # a module called twice
        if self.flip:
            h = checkpoint(self.blocks[3], h, use_reentrant=self.reentrant)
            h = self.blocks[2](h)
        else:
            h = self.blocks[2](h)
            h = checkpoint(self.blocks[3], h, use_reentrant=self.reentrant)
        h = torch.tanh(self.frozen(h))
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def make_model(seed: int) -> S3Net:
    torch.manual_seed(seed)
    return S3Net()


def flip_for(step: int) -> bool:
    return step % 3 == 1


def batch(
    case_seed: int, step: int, micro: int, rank: int, micro_batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case_seed * 1_000_003 + step * 1009 + micro * 101 + rank)
    ids = torch.randint(0, VOCAB, (micro_batch, SEQ), generator=g)
    return ids, torch.roll(ids, 1, dims=1)


Ref = _ref.RefResult


def reference(
    model: S3Net,
    *,
    dtype: torch.dtype,
    world: int,
    steps: int,
    accum: int,
    micro_batch: int,
    seed: int,
    clip: float,
    lr: float,
    weight_decay: float,
    device: torch.device | str = "cpu",
) -> Ref:
    """The shared reference trainer (_reference.py) on S3Net's batches, with the step's
    control-flow flip and an evaluation batch after every step."""

    def flip(compute: nn.Module, step: int) -> None:
        compute.flip = flip_for(step)

    out = _ref.reference_train(
        model,
        dtype=dtype,
        world=world,
        steps=steps,
        accum=accum,
        batch=lambda step, micro, rank: batch(seed, step, micro, rank, micro_batch),
        clip=clip,
        make_optimizer=_ref.adamw(lr, weight_decay, device),
        device=device,
        before_step=flip,
        eval_batch=lambda step: batch(seed, step, 99, 0, micro_batch),
    )
    assert all(math.isfinite(n) for n in out.norms)
    return out
