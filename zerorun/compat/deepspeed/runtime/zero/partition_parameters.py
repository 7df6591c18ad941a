"""``deepspeed.runtime.zero.partition_parameters``: ``Init`` and ``GatheredParameters``, plus
the constructor wrapper transformers patches around ``from_pretrained``.

zerorun's ``zero.Init`` partitions each module's parameters when its ``__init__`` returns
(runtime/stage3/zero_init.py); floating parameters are partitioned in DeepSpeed's dtype (``dtype=``,
else the config's: bf16 or fp16 when enabled, else fp32), and kept where the config's
``offload_param.device`` says (host memory for ``cpu``/``nvme``), as DeepSpeed's. It does not wrap torch's tensor
constructors as DeepSpeed's does, so buffers keep the dtype they were created in and
``zero_wrapper_for_fp_tensor_constructor`` is not called by zerorun. It is here, with DeepSpeed's behaviour, for code that patches it
(transformers' ``prevent_arange_dtype_change``) or calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zerorun import zero as _zero
from zerorun.compat.deepspeed._config_view import runtime_view
from zerorun.compat.deepspeed._surface import module_getattr
from zerorun.compat.deepspeed.accelerator import get_accelerator
from zerorun.config import ZerorunConfig
from zerorun.errors import RuntimeConfigError

__all__ = [
    "Init",
    "GatheredParameters",
    "register_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
    "get_accelerator",
]

_orig_torch_arange = torch.arange
register_external_parameter = _zero.register_external_parameter
__getattr__ = module_getattr(__name__)


def deepspeed_state_dict_semantics() -> None:
    """Under this layer ``module.state_dict()`` of a partitioned model holds placeholders, as
    with DeepSpeed (transformers' ZeRO-3 ``from_pretrained`` calls it on every rank for the keys
    only; assembling would put the whole model on every rank). Full weights come from
    ``engine._zero3_consolidated_16bit_state_dict()``, ``save_16bit_model`` or
    ``GatheredParameters``."""
    from zerorun.runtime.stage3.model_io import set_full_state_dict

    set_full_state_dict(False)


def GatheredParameters(  # noqa: N802 - DeepSpeed's name
    params: Any, modifier_rank: int | None = None, fwd_module: torch.nn.Module | None = None, enabled: bool = True
) -> Any:
    """``deepspeed.zero.GatheredParameters``: full values of the *partitioned* parameters among
    ``params`` inside the block; with ``modifier_rank=r`` rank r's values are kept on exit.
    Other tensors are left alone, as in DeepSpeed (zerorun's own API would broadcast them from
    ``r``, which needs the same order on every rank -- callers pass sets)."""
    if params is None:
        params = []
    elif isinstance(params, torch.Tensor):
        params = [params]
    partitioned = [
        p for p in params if p is not None and (hasattr(p, "_zerorun_init") or hasattr(p, "_zerorun_group"))
    ]
    return _zero.GatheredParameters(partitioned, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=enabled)


def _validated(cfg: object) -> ZerorunConfig:
    """The config as zerorun's validated, typed settings: ``cfg`` is what DeepSpeed's
    ``zero.Init`` takes -- a config dict (transformers passes its ``HfDeepSpeedConfig``'s), a
    path, or an object holding one in ``.config`` (``HfDeepSpeedConfig``, a ``LoadedConfig``).
    A config no run could use is refused here with the loader's message, as initialize would."""
    inner = getattr(cfg, "config", cfg)
    if isinstance(inner, ZerorunConfig):
        return inner
    if isinstance(inner, (dict, str, Path)):
        from zerorun.config import load_config

        # The view deepspeed.initialize validates (accelerate's steps_per_print: inf, ...).
        return load_config(runtime_view(inner) if isinstance(inner, dict) else inner).config
    raise RuntimeConfigError(
        f"deepspeed.zero.Init: config_dict_or_path must be a config dict or a path to a config file, not "
        f"{type(cfg).__name__}"
    )


def init_dtype(cfg: object, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype DeepSpeed's ``zero.Init`` creates parameters in: ``dtype`` when given, else the
    config's (bf16, fp16, or fp32 when neither is enabled; ``"auto"`` counts as not enabled).
    Without either, parameters keep the dtype they were created in (DeepSpeed would pick fp16
    or bf16 by what the accelerator supports)."""
    if dtype is not None:
        return dtype
    if cfg is None:
        return None
    settings = _validated(cfg)
    if settings.bf16.enabled is True:
        return torch.bfloat16
    if settings.fp16.enabled is True:
        return torch.float16
    return torch.float32


def init_remote_device(cfg: object, remote_device: str | None) -> str | None:
    """Where DeepSpeed's ``zero.Init`` keeps the parameter slices until ``initialize``: the
    config's ``zero_optimization.offload_param.device`` when the config has that section (it
    overrides the argument, as in DeepSpeed; ``none`` there means the training device), else
    ``remote_device``. So ``from_pretrained`` under ``offload_param: cpu`` keeps the model in host
    memory, not on the GPU (on CPU ranks both are the same memory)."""
    if cfg is None:
        return remote_device
    zero = _validated(cfg).zero_optimization
    if "offload_param" not in zero.model_fields_set:
        return remote_device
    return zero.offload_param.device


class Init(_zero.Init):
    """``deepspeed.zero.Init``. The config (validated as ``deepspeed.initialize`` validates it)
    must say stage 3; the process group is created if none exists."""

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: Any = None,
        mpu: Any = None,
        **kwargs: Any,
    ) -> None:
        if mpu is not None:
            raise RuntimeConfigError("deepspeed.zero.Init(mpu=...): model parallelism is not supported by zerorun")
        cfg = config if config is not None else config_dict_or_path
        settings = _validated(cfg) if cfg is not None else None
        stage = settings.zero_optimization.stage if settings is not None else None
        if enabled and stage is not None and stage != 3:
            raise RuntimeConfigError(
                f"deepspeed.zero.Init partitions parameters, which only ZeRO stage 3 keeps partitioned: the "
                f"config has zero_optimization.stage {stage}. Set stage: 3, or build the model "
                "without zero.Init."
            )
        deepspeed_state_dict_semantics()
        super().__init__(
            module=module,
            data_parallel_group=data_parallel_group,
            mem_efficient_linear=mem_efficient_linear,
            remote_device=init_remote_device(settings, remote_device),
            pin_memory=pin_memory,
            enabled=enabled,
            dtype=init_dtype(settings, dtype),
            **kwargs,
        )


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype, target_device: Any = None
) -> Callable[..., torch.Tensor]:
    """DeepSpeed's constructor wrapper: the tensor on ``target_device`` (default: this rank's
    device), floating results cast to ``target_fp_dtype``."""

    def wrapped_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None:
            kwargs["device"] = target_device if target_device is not None else get_accelerator().current_device_name()
        tensor = fn(*args, **kwargs)
        if tensor.is_floating_point():
            tensor = tensor.to(target_fp_dtype)
        return tensor

    return wrapped_fn
