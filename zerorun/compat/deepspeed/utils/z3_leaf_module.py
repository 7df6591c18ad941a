"""``deepspeed.utils`` leaf modules for ZeRO-3 (``set_z3_leaf_modules`` & co.).

A module flagged ``_z3_leaf`` is gathered as one unit with all its children before its forward
and released after it (runtime/stage3/groups.py reads the flag when stage 3 is built): what
mixture-of-experts blocks need, where a step may not run every expert, so per-expert gathering
would wait for experts that never run. Flag the modules before ``deepspeed.initialize``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zerorun.compat.deepspeed._surface import module_getattr

__all__ = [
    "z3_leaf_module",
    "z3_leaf_parameter",
    "get_z3_leaf_modules",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
]

__getattr__ = module_getattr(__name__)


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """Whether ``model`` is flagged as a leaf module."""
    return bool(getattr(model, "_z3_leaf", False))


def z3_leaf_parameter(model: torch.nn.Parameter) -> bool:
    """Whether ``model`` (a parameter) belongs to a leaf module."""
    return bool(getattr(model, "ds_z3_leaf_module", False))


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` flagged as leaf modules."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def _matches(module: torch.nn.Module, classes: Sequence[type | str]) -> bool:
    for cls in classes:
        if isinstance(cls, str):
            if type(module).__name__ == cls or f"{type(module).__module__}.{type(module).__qualname__}" == cls:
                return True
        elif type(module) is cls:
            return True
    return False


def _set_flag(
    model: torch.nn.Module, classes: Sequence[type | str], flag: bool, raise_if_not_found: bool
) -> list[torch.nn.Module]:
    if isinstance(classes, (str, type)):
        classes = [classes]
    for cls in classes:
        if not isinstance(cls, (str, type)):
            raise TypeError(f"leaf_module_classes must be classes or class names, got {cls!r}")
    found = [m for m in model.modules() if _matches(m, classes)]
    for m in found:
        m._z3_leaf = flag
        for p in m.parameters():
            p.ds_z3_leaf_module = flag  # type: ignore[attr-defined]
    if not found and raise_if_not_found:
        names = [c if isinstance(c, str) else c.__name__ for c in classes]
        raise ValueError(f"no module of class {names} in the model ({type(model).__name__})")
    return found


def set_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[torch.nn.Module]:
    """Flag every module of ``model`` whose class is in ``leaf_module_classes`` (classes, or
    class names) as a leaf; returns those modules."""
    return _set_flag(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[torch.nn.Module]:
    """Remove the leaf flag from the modules of those classes; returns them."""
    return _set_flag(model, leaf_module_classes, False, raise_if_not_found)
