"""DeepSpeed's ``deepspeed.zero`` surface for ZeRO stage 3 (docs/stage3.md).

    with zerorun.zero.Init(config="ds_config.json"):
        model = MyModel()                 # each rank keeps only its slice of every parameter
    zerorun.zero.load_pretrained(model, "weights/")   # optional: only this rank's slices are read
    engine, *_ = zerorun.initialize(model=model, config="ds_config.json")

    with zerorun.zero.GatheredParameters(engine.module.head.weight, modifier_rank=0):
        if engine.global_rank == 0:
            engine.module.head.weight.mul_(0.5)  # broadcast and re-partitioned on exit

Everything here is collective: every rank runs the same calls in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from zerorun.errors import RuntimeConfigError

__all__ = ["Init", "GatheredParameters", "load_pretrained", "register_external_parameter"]


class Init:
    """Partition parameters as the model is constructed (``deepspeed.zero.Init``).

    ``config`` / ``config_dict_or_path``: the training config (checked: it must be stage 3).
    ``module``: partition an already-built module at once instead of acting as a context.
    ``enabled=False`` makes the context do nothing. ``remote_device="cpu"`` keeps the slices in
    host memory until ``initialize`` places them. Slices keep the dtype the parameters were created
    in (so fp32 master weights start exact; stage 3 casts them to the compute dtype in
    ``initialize``) unless ``dtype`` is given: floating parameters are then partitioned in that
    dtype, as DeepSpeed's ``zero.Init`` does (``deepspeed.zero.Init`` passes the config's 16-bit
    dtype). ``mem_efficient_linear``, ``pin_memory`` and the DeepSpeed group arguments are
    accepted for compatibility.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: Any = None,
        mpu: Any = None,
        **_ignored: Any,
    ) -> None:
        self.enabled = enabled
        self._ctx: Any = None
        if not enabled:
            return
        cfg = config if config is not None else config_dict_or_path
        if cfg is not None:
            self._check_stage(cfg)
        import torch

        from zerorun.runtime.collectives import Communicator
        from zerorun.runtime.distributed import init_distributed
        from zerorun.runtime.stage3.model_io import install_state_dict_hooks
        from zerorun.runtime.stage3.zero_init import InitContext, partition_module

        ctx = init_distributed()
        store = torch.device("cpu") if remote_device in ("cpu", "nvme") else None
        group = data_parallel_group if data_parallel_group is not None else ctx.group
        self.comm = Communicator(group, ctx.device)
        if module is not None:
            partition_module(module, self.comm, store, dtype)
            install_state_dict_hooks(module)
            self.enabled = False  # nothing left to do as a context
            return
        self._ctx = InitContext(self.comm, store, dtype)

    @staticmethod
    def _check_stage(cfg: Any) -> None:
        from zerorun.runtime.api import load_runtime_config

        loaded = load_runtime_config(cfg, 1)
        zero = getattr(loaded, "zero_optimization", None)
        stage = getattr(zero, "stage", 0) if zero is not None else 0
        if stage != 3:
            raise RuntimeConfigError(
                f"zerorun.zero.Init partitions parameters, which only ZeRO stage 3 keeps partitioned: the config "
                f"has zero_optimization.stage {stage}. Set stage: 3, or build the model without zero.Init."
            )

    def __enter__(self) -> Init:
        if self._ctx is not None:
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


def GatheredParameters(  # noqa: N802 - DeepSpeed's name
    params: Any, modifier_rank: int | None = None, fwd_module: nn.Module | None = None, enabled: bool = True
) -> Any:
    """Full parameters inside the ``with`` block (``deepspeed.zero.GatheredParameters``).
    ``modifier_rank=None``: read only (changes are discarded). ``modifier_rank=r``: rank ``r``'s
    values are broadcast and partitioned again on exit (masters too). Works for parameters
    partitioned by stage 3 or by ``Init``; other parameters are broadcast from ``r``."""
    from zerorun.runtime.stage3.model_io import GatheredParameters as _Gathered

    return _Gathered(params, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=enabled)


def load_pretrained(module: nn.Module, source: str | Path | Mapping[str, Any], *, strict: bool = True) -> list[str]:
    """Load weights (a state dict, a ``.safetensors`` file or a directory of shards) into a
    partitioned model slice by slice; each rank reads only the rows it keeps."""
    from zerorun.runtime.stage3.model_io import load_pretrained as _load

    return _load(module, source, strict=strict)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """``parameter`` is used by ``module``'s forward although another module owns it (DeepSpeed's
    API). Call before ``initialize``: the parameter then belongs to the root group, gathered from
    the start of the forward to the end of the backward. (Parameters *registered* in modules of
    two groups -- tied weights -- go there automatically.)"""
    parameter._zerorun_external = True  # type: ignore[attr-defined]
