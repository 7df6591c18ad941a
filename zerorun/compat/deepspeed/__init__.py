"""``import deepspeed`` under ``zerorun --deepspeed-compat``: DeepSpeed's API on zerorun's runtime.

The surface is what DeepSpeed training scripts and Hugging Face Trainer/accelerate use
(measured: the project's hf-trainer-deepspeed surface trace) -- ``initialize``,
``DeepSpeedEngine``, ``add_config_arguments``, ``init_distributed``, ``comm``, ``zero``,
``ops.adam``, ``runtime.lr_schedules``, ``checkpoint.utils``, ``checkpointing`` (activation
checkpointing), ``accelerator``, ``utils``.
Anything else raises an error naming the symbol, never a silent no-op. Cheap to import
(accelerate imports it on every ``unwrap_model``): the runtime loads on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from zerorun.compat.activation import COMPAT_VERSION
from zerorun.compat.deepspeed._surface import module_getattr, unsupported
from zerorun.compat.deepspeed.config_args import add_config_arguments

__all__ = [
    "__version__",
    "initialize",
    "init_distributed",
    "add_config_arguments",
    "DeepSpeedEngine",
    "comm",
    "zero",
    "ops",
    "runtime",
    "checkpoint",
    "checkpointing",
    "accelerator",
    "utils",
    "init_inference",
    "tp_model_init",
]

__version__ = COMPAT_VERSION
_public = COMPAT_VERSION.split("+")[0].split(".")
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in _public)
__git_hash__ = None
__git_branch__ = None

_SUBMODULES = ("comm", "ops", "runtime", "checkpoint", "checkpointing", "accelerator", "utils")
_missing = module_getattr(__name__)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "zero":
        return importlib.import_module(f"{__name__}.runtime.zero")
    if name == "initialize":
        return importlib.import_module(f"{__name__}._initialize").initialize
    if name == "DeepSpeedEngine":
        return importlib.import_module(f"{__name__}.runtime.engine").DeepSpeedEngine
    return _missing(name)


def init_distributed(*args: Any, **kwargs: Any) -> None:
    """``deepspeed.init_distributed`` (same as ``deepspeed.comm.init_distributed``)."""
    from zerorun.compat.deepspeed.comm import init_distributed as _init

    _init(*args, **kwargs)


def init_inference(*_args: Any, **_kwargs: Any) -> Any:
    unsupported("deepspeed.init_inference", "DeepSpeed-Inference (kernel injection, inference TP) is not part of zerorun")


def tp_model_init(*_args: Any, **_kwargs: Any) -> Any:
    unsupported(
        "deepspeed.tp_model_init",
        "tensor parallelism (tensor_parallel.autotp_size > 1) is not supported by zerorun: remove the "
        "tensor_parallel section; ZeRO stage 3 shards parameters instead",
    )
