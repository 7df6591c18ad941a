"""Tiny models with the awkward features (tied weights, a frozen layer, an unused branch, a
branch used only on some ranks, sizes not divisible by 4), their batches, and the stage 0-2
workers' call of the one single-process reference trainer (_reference.py; TinyNet.never is the
parameter no micro-batch uses, stepped with a zero gradient as DeepSpeed does).
"""

from __future__ import annotations

import _reference as _ref  # tests/runtime is the workers' script folder (not a package import)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _reference import RefResult
from torch import nn

__all__ = ["TinyNet", "make_model", "batch", "reference_train", "RefResult", "full_masters"]

VOCAB, DIM, HID, SEQ = 13, 7, 11, 5


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)  # 91 elements
        self.up = nn.Linear(DIM, HID)  # 77 + 11
        self.frozen = nn.Linear(HID, HID)  # not trained
        self.frozen.requires_grad_(False)
        self.mid = nn.Linear(HID, HID)  # 121 + 11
        self.sometimes = nn.Linear(HID, HID, bias=False)  # used only when the batch asks for it
        self.never = nn.Linear(HID, 3)  # never used: its bucket still takes part
        self.down = nn.Linear(HID, DIM)  # 77 + 7
        self.norm = nn.LayerNorm(DIM)  # 7 + 7
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, HID))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(self.emb(ids)))
        h = torch.tanh(self.frozen(h)) + self.offset
        h = F.gelu(self.mid(h))
        if int(ids[0, 0]) % 2 == 0:  # data-dependent: on some ranks/micro-batches only
            h = h + self.sometimes(h)
        x = self.norm(self.down(h))
        logits = self.head(x)
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


class ResidualBlock(nn.Module):
    """A pre-norm residual MLP block (the workers that build small transformers repeat it)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.mlp(self.norm(x)))


def make_model(seed: int) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def batch(
    case_seed: int, step: int, micro: int, rank: int, micro_batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case_seed * 1_000_003 + step * 1009 + micro * 101 + rank)
    ids = torch.randint(0, VOCAB, (micro_batch, SEQ), generator=g)
    return ids, torch.roll(ids, 1, dims=1)


def reference_train(
    model: nn.Module,
    *,
    dtype: torch.dtype,
    world: int,
    steps: int,
    accum: int,
    micro_batch: int,
    case_seed: int,
    clip: float,
    lr: float,
    weight_decay: float,
    scales: list[float] | None = None,
    inject: set[tuple[int, int]] | None = None,  # (step, rank) whose loss is multiplied by inf
    device: torch.device | str = "cpu",
) -> RefResult:
    """The shared reference trainer (_reference.py) on TinyNet's batches with AdamW."""
    return _ref.reference_train(
        model,
        dtype=dtype,
        world=world,
        steps=steps,
        accum=accum,
        batch=lambda step, micro, rank: batch(case_seed, step, micro, rank, micro_batch),
        clip=clip,
        make_optimizer=_ref.adamw(lr, weight_decay, device),
        device=device,
        scales=scales,
        inject=inject,
    )


def full_masters(engine) -> dict[str, torch.Tensor]:  # noqa: ANN001 - a zerorun engine
    """All-gather every rank's fp32 master shards (on the device or offloaded) and cut them
    into named parameters, on the CPU."""
    state = engine.stage.state
    state.synchronize()  # an offloaded (possibly delayed) step may still be writing them
    out = {}
    # gloo gathers CPU tensors (also when the ranks share a GPU); NCCL needs CUDA ones.
    on = engine.device if dist.get_backend() == "nccl" else torch.device("cpu")
    for layout, master in zip(state.layouts, state.masters, strict=True):
        full = torch.empty(layout.padded_numel, dtype=torch.float32, device=on)
        if layout.num_shards > 1:
            dist.all_gather_into_tensor(full, master.detach().float().contiguous().to(on))
        else:
            full.copy_(master.detach().float())
        full = full.cpu()
        for slot in layout.slots:
            out[slot.name] = full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
    return out
