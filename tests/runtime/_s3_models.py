"""The stage-3 test model and its single-process reference.

S3Net has what stage 3 finds hard: repeated blocks (>= 3 partitioned groups with the test's
persistence threshold), the embedding tied to the head (root group), a weight tied between two
blocks (two groups -> root group), a block called twice in one forward, a data-dependent branch
that swaps two blocks between steps (same on every rank within a step), activation
checkpointing around one block (non-reentrant, or reentrant when asked) and inside another, a
frozen layer, a never-used layer, and sizes not divisible by 4.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

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


@dataclass
class Ref:
    losses: list[list[list[float]]] = field(default_factory=list)  # [step][micro][rank]
    eval_losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    master: dict[str, torch.Tensor] = field(default_factory=dict)
    compute: dict[str, torch.Tensor] = field(default_factory=dict)


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
    """Plain PyTorch on the global batch, with the runtime's mixed-precision recipe (16-bit
    compute copy, fp32 masters, fp32 accumulation of each micro-batch's 16-bit gradients). Runs
    on the ranks' device (the same matmul kernels: CPU and CUDA bf16 results differ by more
    than the tolerances); results come back on the CPU."""
    master = model.to(device)
    compute = copy.deepcopy(master).to(dtype) if dtype != torch.float32 else master
    m_params = [p for p in master.parameters() if p.requires_grad]
    c_params = [p for p in compute.parameters() if p.requires_grad]
    # The runtime's kernel (runtime/optimizer.py: fused AdamW on CUDA, torch's default on CPU):
    # fused and foreach AdamW differ in the last fp32 bit, which can flip a 16-bit weight.
    fused = {"fused": True} if torch.device(device).type == "cuda" else {}
    opt = torch.optim.AdamW(m_params, lr=lr, weight_decay=weight_decay, **fused)
    out = Ref()
    for step in range(steps):
        compute.flip = flip_for(step)
        total = [torch.zeros_like(p, dtype=torch.float32) for p in m_params]
        step_losses = [[0.0] * world for _ in range(accum)]
        for rank in range(world):
            acc = [torch.zeros_like(p, dtype=torch.float32) for p in m_params]
            for micro in range(accum):
                ids, tgt = batch(seed, step, micro, rank, micro_batch)
                loss = compute(ids.to(device), tgt.to(device))
                step_losses[micro][rank] = float(loss)
                (loss / accum).backward()
                for a, p in zip(acc, c_params, strict=True):
                    if p.grad is not None:
                        a.add_(p.grad)
                        p.grad = None
            for t, a in zip(total, acc, strict=True):
                t.add_(a / world)
        out.losses.append(step_losses)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in total]))
        out.norms.append(float(norm))
        coef = torch.clamp(torch.tensor(clip) / (norm + 1e-6), max=1.0) if clip > 0 else None
        for p, t in zip(m_params, total, strict=True):
            p.grad = t * coef if coef is not None else t
        opt.step()
        opt.zero_grad(set_to_none=True)
        if compute is not master:
            with torch.no_grad():
                for c, m in zip(c_params, m_params, strict=True):
                    c.copy_(m)
        with torch.no_grad():
            ids, tgt = batch(seed, step, 99, 0, micro_batch)
            out.eval_losses.append(float(compute(ids.to(device), tgt.to(device))))
    out.master = {n: p.detach().cpu().clone() for n, p in master.named_parameters()}
    out.compute = {n: p.detach().cpu().clone() for n, p in compute.named_parameters()}
    assert all(math.isfinite(n) for n in out.norms)
    return out
