"""``deepspeed.checkpoint.utils``."""

from __future__ import annotations

from typing import Any

import torch

from zerorun.compat.deepspeed._surface import module_getattr

__all__ = ["clone_tensors_for_torch_save"]

__getattr__ = module_getattr(__name__)


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    """Copies of every tensor in ``item`` (nested lists/tuples/dicts) on ``device``, so that
    ``torch.save`` writes each tensor's own values, not the whole storage a view shares
    (a parameter that is a view of a flat buffer would otherwise save the whole buffer)."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
