"""The CPU optimizer step, tile by tile, with zerorun's CPU Adam(W) kernel (cpu_kernel.py; torch's
fused one where that cannot be built).

``optimizer.step()`` updates whole master shards at once, which leaves nothing to overlap: the
offload pipeline needs to step *tiles* (a range of one master) so that the gradient copy of the
next tile and the parameter copy of the previous one run while this one is computed. For the
Adam family the update is elementwise, so stepping a tile with a fused kernel (cpu_kernel's, or
``torch._fused_adam_`` / ``torch._fused_adamw_``: vectorised and multi-threaded, several times
faster than the default CPU loop; both compute alike, bit for bit) on slices of the optimizer's
own state tensors gives exactly what ``optimizer.step()`` would. The state keeps torch's keys and types (``step``, ``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq``), so checkpoints and ``optimizer.state_dict()`` do not see a
difference. Other optimizers go through ``optimizer.step()`` (correct, not pipelined).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from zerorun.runtime.offload import cpu_kernel

__all__ = ["AdamHyper", "supports_tiles", "hyper_of", "ensure_state", "adam_tile"]


@dataclass(frozen=True)
class AdamHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool
    decoupled: bool


def supports_tiles(optimizer: Optimizer) -> bool:
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or not hasattr(torch, "_fused_adamw_"):
        return False
    return all(not g.get("differentiable", False) for g in optimizer.param_groups)


def _f(value: Any) -> float:
    return float(value.item()) if torch.is_tensor(value) else float(value)


def hyper_of(optimizer: Optimizer, group: dict[str, Any]) -> AdamHyper:
    """The group's hyperparameters *now* (read on the training thread: the scheduler changes
    ``lr`` right after the step is launched)."""
    beta1, beta2 = group["betas"]
    decoupled = bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
    return AdamHyper(
        lr=_f(group["lr"]),
        beta1=_f(beta1),
        beta2=_f(beta2),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        amsgrad=bool(group.get("amsgrad", False)),
        maximize=bool(group.get("maximize", False)),
        decoupled=decoupled,
    )


def ensure_state(
    optimizer: Optimizer, master: torch.Tensor, hyper: AdamHyper, make: Any = None
) -> dict[str, torch.Tensor]:
    """The master's Adam state, created the way torch's Adam creates it (``make(key)`` supplies
    the tensor for an elementwise state when the caller wants it elsewhere, e.g. in a file)."""
    state = optimizer.state[master]
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if hyper.amsgrad else [])
        for key in keys:
            state[key] = make(key) if make is not None else torch.zeros_like(master)
    return state


def adam_tile(
    p: torch.Tensor,
    g: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: torch.Tensor | None,
    step: torch.Tensor,
    h: AdamHyper,
) -> None:
    """One Adam(W) update of a tile in place. ``step`` is the master's step counter, already
    incremented for this step (the fused kernel reads it for the bias correction). On the CPU
    zerorun's kernel (cpu_kernel.py) runs it, widening a bf16 gradient (``options.narrow_grads``)
    in the same pass; where that cannot run (AMSGrad, no compiler) torch's fused kernel does,
    on a widened copy of a bf16 gradient."""
    tensors = (p, g, exp_avg, exp_avg_sq)
    if (
        p.device.type == "cpu"
        and p.dtype == torch.float32
        and g.dtype in (torch.bfloat16, torch.float32)
        and all(t.is_contiguous() for t in tensors)
    ):
        kernel = None if h.amsgrad else cpu_kernel.load()
        if kernel is not None:
            kernel.step(
                p,
                g,
                exp_avg,
                exp_avg_sq,
                step=float(step.item()),
                lr=h.lr,
                beta1=h.beta1,
                beta2=h.beta2,
                eps=h.eps,
                weight_decay=h.weight_decay,
                decoupled=h.decoupled,
                maximize=h.maximize,
                threads=torch.get_num_threads(),
            )
            return
    if g.dtype != p.dtype:
        g = g.to(p.dtype)
    fn = torch._fused_adamw_ if h.decoupled else torch._fused_adam_
    fn(
        [p],
        [g],
        [exp_avg],
        [exp_avg_sq],
        [max_exp_avg_sq] if h.amsgrad and max_exp_avg_sq is not None else [],
        [step],
        amsgrad=h.amsgrad,
        lr=h.lr,
        beta1=h.beta1,
        beta2=h.beta2,
        weight_decay=h.weight_decay,
        eps=h.eps,
        maximize=h.maximize,
        grad_scale=None,
        found_inf=None,
    )
