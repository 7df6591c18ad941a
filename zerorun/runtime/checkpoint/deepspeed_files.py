"""DeepSpeed's checkpoint files as files: written and read without DeepSpeed installed.

DeepSpeed's files are ``torch.save`` pickles that hold a few objects of DeepSpeed's own classes
(the loss scaler its ZeRO-3 optimizer reads back, its stage enum). `DeepSpeedObject` names such a
class by its import path, so zerorun writes it as that class and reads it back as a
`DeepSpeedObject` where DeepSpeed is not installed (``deepspeed_layout`` writes the layout,
``deepspeed_read`` reads it back).
"""

from __future__ import annotations

import os
import pickle
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerorun.errors import CheckpointError

__all__ = ["DeepSpeedObject", "save_file", "load_file", "loss_scaler_object"]


@dataclass
class DeepSpeedObject:
    """An object of one of DeepSpeed's classes, by its import path, with its attributes: written as
    that class (DeepSpeed's loader gets its own object back, e.g. the loss scaler its ZeRO-3
    optimizer reads), without DeepSpeed being installed; read back as this where it is not."""

    path: str  # e.g. "deepspeed.runtime.fp16.loss_scaler.LossScaler"
    attributes: dict[str, object]


class _Pickler(pickle._Pickler):  # the Python pickler: it lets a class be named without importing it
    def save(self, obj: object, save_persistent_id: bool = True) -> None:
        if isinstance(obj, DeepSpeedObject):  # what pickling an instance of that class writes
            module, _, name = obj.path.rpartition(".")
            self.write(pickle.GLOBAL + f"{module}\n{name}\n".encode())  # type: ignore[attr-defined]
            self.save(())
            self.write(pickle.NEWOBJ)  # type: ignore[attr-defined]
            self.save(obj.attributes)
            self.write(pickle.BUILD)  # type: ignore[attr-defined]
            return
        super().save(obj, save_persistent_id)  # type: ignore[misc]


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            if module.split(".")[0] != "deepspeed":
                raise
            return _standin_class(f"{module}.{name}")


def _standin_class(path: str) -> type:
    """Where DeepSpeed is not installed, its objects load as DeepSpeedObject(path, attributes)."""

    class Standin(DeepSpeedObject):
        def __new__(cls, *args: object) -> Any:
            """Unpickling calls it: with no arguments for an object (then __setstate__ with its
            attributes), with the value for an enum (DeepSpeed's ZeroStageEnum: the value is
            what counts), with the fields for a namedtuple (kept as ``args``)."""
            if len(args) == 1 and isinstance(args[0], (bool, int, float, str)):
                return args[0]
            obj = object.__new__(cls)
            obj.path, obj.attributes = path, ({"args": args} if args else {})
            return obj

        def __init__(self, *args: object) -> None:  # fields set in __new__
            pass

        def __setstate__(self, state: dict[str, object]) -> None:
            self.attributes.update(state)

    return Standin


_PICKLE = types.ModuleType("zerorun_deepspeed_pickle")
_PICKLE.Pickler = _Pickler  # type: ignore[attr-defined]
_PICKLE.Unpickler = _Unpickler  # type: ignore[attr-defined]
_PICKLE.load = pickle.load  # type: ignore[attr-defined]


def save_file(obj: object, path: Path) -> None:
    """Write one DeepSpeed-layout file under a temporary name, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f, pickle_module=_PICKLE)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """One DeepSpeed-layout file (``torch.load``; DeepSpeed's objects in it as `DeepSpeedObject`
    where DeepSpeed is not installed)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise CheckpointError(f"{path}: cannot read ({err})") from err


def loss_scaler_object(
    scale: float, *, dynamic: bool, state: dict[str, float | int | bool] | None = None
) -> DeepSpeedObject:
    """DeepSpeed's loss scaler with zerorun's scaler state: ``LossScaler`` (static: bf16, fp32,
    fp16 with a fixed ``loss_scale``) or ``DynamicLossScaler`` (fp16) with its attributes --
    ``state``: cur_iter, last_overflow_iter, window, min_scale, hysteresis, cur_hysteresis,
    consecutive_hysteresis, raise_error_at_min_scale."""
    base = "deepspeed.runtime.fp16.loss_scaler."
    if not dynamic:
        return DeepSpeedObject(base + "LossScaler", {"cur_scale": float(scale), "dynamic": False})
    st = state or {}
    return DeepSpeedObject(base + "DynamicLossScaler", {
        "cur_scale": float(scale), "dynamic": True, "cur_iter": int(st.get("cur_iter", 0)),
        "last_overflow_iter": int(st.get("last_overflow_iter", -1)), "scale_factor": 2.0,
        "scale_window": int(st.get("window", 1000)), "min_scale": float(st.get("min_scale", 1.0)),
        "delayed_shift": int(st.get("hysteresis", 2)), "cur_hysteresis": int(st.get("cur_hysteresis", 2)),
        "consecutive_hysteresis": bool(st.get("consecutive_hysteresis", False)),
        "raise_error_at_min_scale": bool(st.get("raise_error_at_min_scale", True)), "dtype": torch.float16,
    })
