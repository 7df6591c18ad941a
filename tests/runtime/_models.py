"""Tiny models with the awkward features (tied weights, a frozen layer, an unused branch, a
branch used only on some ranks, sizes not divisible by 4) and the single-process reference.

The reference is plain PyTorch on the same global batch. For bf16/fp16 it follows the same
recipe as the runtime: a 16-bit compute copy, fp32 master weights, each micro-batch's 16-bit
gradients accumulated in fp32, averaged over ranks, fp16 loss scaling with skipped steps.
One deliberate difference from a bare PyTorch loop: a trainable parameter that no micro-batch
used (TinyNet.never) gets a zero gradient and is still stepped (AdamW's weight decay), which is
DeepSpeed's (and zerorun's) semantics; bare PyTorch would skip a parameter whose grad is None.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

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


def make_model(seed: int) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def batch(
    case_seed: int, step: int, micro: int, rank: int, micro_batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case_seed * 1_000_003 + step * 1009 + micro * 101 + rank)
    ids = torch.randint(0, VOCAB, (micro_batch, SEQ), generator=g)
    return ids, torch.roll(ids, 1, dims=1)


@dataclass
class RefResult:
    losses: list[list[list[float]]] = field(default_factory=list)  # [step][micro][rank]
    norms: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    master: dict[str, torch.Tensor] = field(default_factory=dict)
    compute: dict[str, torch.Tensor] = field(default_factory=dict)


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
    master = model.to(device)
    compute = copy.deepcopy(master).to(dtype) if dtype != torch.float32 else master
    m_params = [p for p in master.parameters() if p.requires_grad]
    c_params = [p for p in compute.parameters() if p.requires_grad]
    # The runtime's kernel (runtime/optimizer.py: fused AdamW on CUDA, torch's default on CPU):
    # fused and foreach AdamW differ in the last fp32 bit, which can flip a 16-bit weight.
    fused = {"fused": True} if torch.device(device).type == "cuda" else {}
    opt = torch.optim.AdamW(m_params, lr=lr, weight_decay=weight_decay, **fused)
    out = RefResult()
    for step in range(steps):
        scale = scales[step] if scales else 1.0
        total = [torch.zeros_like(p, dtype=torch.float32) for p in m_params]
        step_losses: list[list[float]] = [[0.0] * world for _ in range(accum)]
        for rank in range(world):
            acc = [torch.zeros_like(p, dtype=torch.float32) for p in m_params]
            for micro in range(accum):
                ids, tgt = batch(case_seed, step, micro, rank, micro_batch)
                loss = compute(ids.to(device), tgt.to(device))
                step_losses[micro][rank] = float(loss)
                if inject and (step, rank) in inject:
                    loss = loss * math.inf
                (loss * (scale / accum)).backward()
                for a, p in zip(acc, c_params, strict=True):
                    if p.grad is not None:
                        a.add_(p.grad)
                        p.grad = None
            for t, a in zip(total, acc, strict=True):
                t.add_(a / world)
        out.losses.append(step_losses)
        norm = (
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in total])) / scale
        ).cpu()
        out.norms.append(float(norm))
        if not math.isfinite(float(norm)):
            out.skipped.append(True)
            continue
        out.skipped.append(False)
        coef = min(1.0, clip / (float(norm) + 1e-6)) if clip > 0 else 1.0
        coef_t = torch.clamp(torch.tensor(clip) / (norm + 1e-6), max=1.0) if clip > 0 else None
        for p, t in zip(m_params, total, strict=True):
            p.grad = t / scale if scale != 1.0 else t
            if coef_t is not None:
                p.grad.mul_(coef_t.to(device))
        del coef
        opt.step()
        opt.zero_grad(set_to_none=True)
        if compute is not master:
            with torch.no_grad():
                for c, m in zip(c_params, m_params, strict=True):
                    c.copy_(m)
    out.master = {n: p.detach().cpu().clone() for n, p in master.named_parameters()}
    out.compute = {n: p.detach().cpu().clone() for n, p in compute.named_parameters()}
    return out


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
