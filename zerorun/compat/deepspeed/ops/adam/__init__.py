"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` and ``FusedAdam`` as torch Adam/AdamW.

No kernels are built: zerorun steps the optimizer on its fp32 master shards, and with
``offload_optimizer.device: cpu|nvme`` its CPU placement runs torch's fused CPU Adam kernel in
tiles (runtime/offload/adam.py) -- the job DeepSpeed's C++ ``cpu_adam`` does. ``adamw_mode``
selects decoupled weight decay (AdamW) for every group, as in DeepSpeed; the other
hyperparameters are per group: accelerate hands over the Trainer optimizer's groups with their
own betas/eps/weight decay and only ``lr``/``weight_decay`` as defaults.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zerorun.compat.deepspeed._surface import module_getattr
from zerorun.compat.deepspeed.ops._groups import copy_groups
from zerorun.errors import RuntimeConfigError

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

__getattr__ = module_getattr(__name__)


class DeepSpeedCPUAdam(torch.optim.Adam):
    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if not bias_correction:
            raise RuntimeConfigError("DeepSpeedCPUAdam(bias_correction=False) is not supported by zerorun (torch Adam corrects bias)")
        if not fp32_optimizer_states:
            raise RuntimeConfigError("DeepSpeedCPUAdam(fp32_optimizer_states=False): zerorun keeps optimizer states in fp32")
        self.adamw_mode = adamw_mode
        super().__init__(
            copy_groups(model_params, decoupled_weight_decay=adamw_mode),
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled_weight_decay=adamw_mode,
        )


class FusedAdam(torch.optim.Adam):
    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        del set_grad_none  # zerorun owns the gradients
        if amsgrad:
            raise RuntimeConfigError("FusedAdam does not support the AMSGrad variant (as in DeepSpeed)")
        if not bias_correction:
            raise RuntimeConfigError("FusedAdam(bias_correction=False) is not supported by zerorun")
        self.adam_w_mode = adam_w_mode
        super().__init__(
            copy_groups(params, decoupled_weight_decay=adam_w_mode),
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=adam_w_mode,
        )
