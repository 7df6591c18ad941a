"""The single-process PyTorch reference every ZeRO equivalence test compares against (stages
0-2: _worker.py, stage 3: _s3_worker.py, offload: _offload_worker.py) -- one trainer, so the
copies cannot drift.

Plain PyTorch on the global batch (every rank's micro-batches, one process), with the
runtime's recipe: a 16-bit compute copy and fp32 master weights in bf16/fp16; each
micro-batch's gradients accumulated in fp32 and averaged over ranks; the global gradient norm,
clipping as torch.nn.utils.clip_grad_norm_ computes it; fp16 loss scaling with the step skipped
on a non-finite norm; optionally the one-step delayed update (the next forward uses the
parameters before the last update). The forward/backward runs on the training device (the same
matmul kernels as the ranks: CPU and CUDA bf16 results differ by more than the tolerances); the
optimizer runs on ``opt_device`` (where the runtime's runs: the CPU with optimizer offload).

One deliberate difference from a bare PyTorch loop: a trainable parameter that no micro-batch
used gets a zero gradient and is still stepped (AdamW's weight decay), which is DeepSpeed's (and
zerorun's) semantics; bare PyTorch would skip a parameter whose grad is None.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class RefResult:
    losses: list[list[list[float]]] = field(default_factory=list)  # [step][micro][rank]
    norms: list[float] = field(default_factory=list)  # unscaled global gradient norm per step
    skipped: list[bool] = field(default_factory=list)  # fp16: non-finite norm, no update
    eval_losses: list[float] = field(default_factory=list)  # with eval_batch: after each step
    master: dict[str, torch.Tensor] = field(default_factory=dict)  # fp32, on the CPU
    compute: dict[str, torch.Tensor] = field(default_factory=dict)  # compute dtype, on the CPU


def adamw(lr: float, weight_decay: float, device: torch.device | str) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """The runtime's AdamW kernel (runtime/optimizer.py: fused on CUDA, torch's default on the
    CPU): fused and foreach AdamW differ in the last fp32 bit, which can flip a 16-bit weight."""
    fused = {"fused": True} if torch.device(device).type == "cuda" else {}
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **fused)


def reference_train(
    model: nn.Module,
    *,
    dtype: torch.dtype,
    world: int,
    steps: int,
    accum: int,
    batch: Callable[[int, int, int], Batch],  # (step, micro, rank) -> (ids, targets)
    clip: float,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    device: torch.device | str = "cpu",
    opt_device: torch.device | str | None = None,  # default: device
    scales: list[float] | None = None,  # fp16: the loss scale of each step (the runtime's)
    inject: set[tuple[int, int]] | None = None,  # (step, rank) whose loss is multiplied by inf
    delayed: bool = False,  # the delayed parameter update, after `warmup` plain steps
    warmup: int = 0,
    before_step: Callable[[nn.Module, int], None] | None = None,  # (compute model, step)
    eval_batch: Callable[[int], Batch] | None = None,  # step -> a batch evaluated after it
) -> RefResult:
    opt_on = torch.device(opt_device if opt_device is not None else device)
    master = model.to(opt_on)
    separate = dtype != torch.float32 or delayed or opt_on != torch.device(device)
    compute = copy.deepcopy(master).to(device, dtype) if separate else master
    m_params = [p for p in master.parameters() if p.requires_grad]
    c_params = [p for p in compute.parameters() if p.requires_grad]
    opt = make_optimizer(m_params)
    out = RefResult()
    taken = 0
    for step in range(steps):
        if before_step is not None:
            before_step(compute, step)
        scale = scales[step] if scales else 1.0
        total = [torch.zeros_like(p, dtype=torch.float32) for p in c_params]
        step_losses: list[list[float]] = [[0.0] * world for _ in range(accum)]
        for rank in range(world):
            acc = [torch.zeros_like(p, dtype=torch.float32) for p in c_params]
            for micro in range(accum):
                ids, tgt = batch(step, micro, rank)
                loss = compute(ids.to(device), tgt.to(device))
                step_losses[micro][rank] = float(loss.detach())
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
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in total])) / scale
        out.norms.append(float(norm))
        out.skipped.append(not math.isfinite(float(norm)))
        if out.skipped[-1]:
            continue
        coef = torch.clamp(torch.tensor(clip) / (norm + 1e-6), max=1.0) if clip > 0 else None
        for p, t in zip(m_params, total, strict=True):
            g = t / scale if scale != 1.0 else t
            if coef is not None:
                g.mul_(coef)
            p.grad = g.to(opt_on)
        before = [p.detach().clone() for p in m_params] if delayed and taken >= warmup else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        taken += 1
        if compute is not master:
            with torch.no_grad():
                for c, m in zip(c_params, before or m_params, strict=True):
                    c.copy_(m)
        if eval_batch is not None:
            with torch.no_grad():
                ids, tgt = eval_batch(step)
                out.eval_losses.append(float(compute(ids.to(device), tgt.to(device))))
    out.master = {n: p.detach().cpu().clone() for n, p in master.named_parameters()}
    out.compute = {n: p.detach().cpu().clone() for n, p in compute.named_parameters()}
    return out
