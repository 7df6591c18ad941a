"""The torch optimizer that runs on this rank's fp32 master shards.

A shard is a slice of a flat buffer and may cut a parameter in two (partition.py), so only
*elementwise* optimizers -- whose update of one element depends only on that element's own
history -- give the same result as on whole parameters. Others (LAMB, LARS, Adafactor, Shampoo:
per-tensor norms or factorizations) are refused unless ``zero_allow_untested_optimizer`` is set.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from zerorun.errors import RuntimeConfigError

__all__ = ["ELEMENTWISE", "build_from_config", "rebind_user_optimizer", "check_elementwise", "fast_kwargs"]

ELEMENTWISE: dict[str, type[Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
    "adamax": torch.optim.Adamax,
    "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam,
    "adadelta": torch.optim.Adadelta,
}

# Bytes of optimizer state per trainable element (fp32 states); Contract 4 uses the same table.
STATE_BYTES_PER_ELEMENT: dict[type[Optimizer], int] = {
    torch.optim.Adam: 8,
    torch.optim.AdamW: 8,
    torch.optim.Adagrad: 4,
    torch.optim.RMSprop: 4,
    torch.optim.Adamax: 8,
    torch.optim.NAdam: 8,
    torch.optim.RAdam: 8,
    torch.optim.Adadelta: 8,
}


def check_elementwise(cls: type[Optimizer], allow_untested: bool) -> None:
    if cls in ELEMENTWISE.values() or allow_untested:
        return
    raise RuntimeConfigError(
        f"optimizer {cls.__name__} is not known to be elementwise: zerorun runs the optimizer on "
        "slices that can cut a parameter in two, which changes the result of optimizers that use "
        "per-tensor norms (LAMB, LARS, Adafactor, ...). Use one of "
        f"{', '.join(c.__name__ for c in ELEMENTWISE.values())}, or set "
        "zero_allow_untested_optimizer: true if you know it is elementwise."
    )


def fast_kwargs(cls: type[Optimizer], device: torch.device, given: dict[str, Any]) -> dict[str, Any]:
    """``fused`` on CUDA where the class has it, else ``foreach``; on CPU torch's own default.
    Whatever the user set explicitly wins."""
    if device.type != "cuda":
        return {}
    sig = inspect.signature(cls.__init__).parameters
    if "fused" in sig and given.get("fused") is None and given.get("foreach") is None:
        return {"fused": True}
    if "foreach" in sig and given.get("foreach") is None and not given.get("fused"):
        return {"foreach": True}
    return {}


def build_from_config(
    type_name: str,
    params: dict[str, Any],
    groups: Sequence[dict[str, Any]],
    device: torch.device,
) -> Optimizer:
    """``optimizer: {type, params}`` -> a torch optimizer over ``groups`` (param-group dicts whose
    ``params`` are master shards). DeepSpeed's ``Adam`` means AdamW unless ``adam_w_mode: false``."""
    key = type_name.lower()
    params = dict(params)
    for name, value in params.items():
        if value == "auto":
            raise RuntimeConfigError(
                f"optimizer.params.{name} is 'auto' and no optimizer was passed to zerorun.initialize "
                "to take it from: set a value in the config"
            )
    adam_w_mode = params.pop("adam_w_mode", True)
    # Keys of DeepSpeed's fused optimizers that torch's have no use for.
    params.pop("torch_adam", None)
    params.pop("set_grad_none", None)
    if params.pop("bias_correction", True) is False:
        raise RuntimeConfigError(
            "optimizer.params.bias_correction: false is not supported (torch's Adam always corrects "
            "the bias); remove the key"
        )
    if key == "adam" and adam_w_mode:
        key = "adamw"
    elif key == "adamw" and not adam_w_mode:
        key = "adam"
    cls = ELEMENTWISE.get(key)
    if cls is None:
        raise RuntimeConfigError(
            f"optimizer.type {type_name!r} is not supported by zerorun; use one of "
            f"{', '.join(c.__name__ for c in ELEMENTWISE.values())} (DeepSpeed's fused/CPU/1-bit "
            "variants map to these), or build a torch optimizer yourself and pass it to initialize"
        )
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    params.update(fast_kwargs(cls, device, params))
    try:
        return cls(list(groups), **params)
    except (TypeError, ValueError) as exc:
        raise RuntimeConfigError(f"optimizer.params for {type_name}: {exc}") from None


def rebind_user_optimizer(
    optimizer: Optimizer, groups: Sequence[dict[str, Any]], allow_untested: bool
) -> Optimizer:
    """Point the user's optimizer object at the master shards, keeping its class, param groups
    and hyperparameters. The same object is kept (not a copy) so a scheduler the script already
    bound to it keeps working."""
    check_elementwise(type(optimizer), allow_untested)
    if any(optimizer.state.values()):
        raise RuntimeConfigError(
            "the optimizer passed to zerorun.initialize has already taken steps; its state cannot be "
            "moved onto zerorun's shards. Pass a fresh optimizer (or load a zerorun checkpoint)."
        )
    if len(groups) != len(optimizer.param_groups):
        raise AssertionError("one master group per user param group expected")
    for group, new in zip(optimizer.param_groups, groups, strict=True):
        group["params"] = list(new["params"])
    optimizer.state.clear()
    return optimizer


def user_group_index(optimizer: Optimizer) -> dict[int, int]:
    """id(param) -> index of the user's param group holding it."""
    return {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}


def normalize_model_parameters(model_parameters: Any) -> list[dict[str, Any]] | None:
    """DeepSpeed's ``model_parameters``: an iterable of tensors or of param-group dicts."""
    if model_parameters is None:
        return None
    items = list(model_parameters)
    if not items:
        return None
    if isinstance(items[0], dict):
        return [dict(g, params=list(g["params"])) for g in items]
    return [{"params": items}]


OptimizerFactory = Callable[[Any], Optimizer]
