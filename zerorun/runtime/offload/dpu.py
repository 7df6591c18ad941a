"""The one-step delayed parameter update (ZeRO-Offload's DPU), behind ``zerorun.delayed_param_update``.

Exact offload runs the CPU optimizer step between backward and the next forward, so the GPU
waits for it. With the delayed update the step of step t is *launched* at the end of step t and
runs on the CPU while the GPU computes step t+1's forward and backward; its result is copied to
the GPU at the end of step t+1. So step t+1's gradients are computed on parameters that lack the
update of step t:

    exact:    theta[t+1] = U(theta[t], grad L_t(theta[t]))
    delayed:  theta[t+1] = U(theta[t], grad L_t(theta[t-1]))        (theta[-1] = theta[0])

This changes the math (one-step-stale gradients, as in ZeRO-Offload, which found it harmless
after the first few steps -- hence ``delayed_param_update_warmup``: that many exact steps first).
Clipping and the fp16 overflow check still see the exact global norm of the gradients they
apply to. After ``engine.step()`` the module's parameters are one update behind the fp32 masters;
``ShardedOptimizerState.synchronize()`` (called by the engine before checkpoints) completes the
step in flight, so a checkpoint holds the newest masters and optimizer states.

Only optimizers the tile kernel supports (Adam, AdamW) are delayed: the step must read its
hyperparameters on the training thread before the scheduler changes them. Others run exactly,
with a warning.
"""

from __future__ import annotations

import warnings

__all__ = ["DelayPolicy"]


class DelayPolicy:
    def __init__(self, enabled: bool, warmup: int) -> None:
        self.enabled = enabled
        self.warmup = max(0, warmup)
        self._warned = False

    def delayed(self, step_index: int, *, tiled: bool, optimizer_name: str) -> bool:
        """Is the optimizer step with this 0-based index delayed?"""
        if not self.enabled or step_index < self.warmup:
            return False
        if not tiled:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"zerorun.delayed_param_update: {optimizer_name} is not supported by the delayed CPU step "
                    "(Adam and AdamW are); the optimizer steps without the delay",
                    stacklevel=3,
                )
            return False
        return True
