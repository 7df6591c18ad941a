"""``deepspeed.ops``: ``adam`` (DeepSpeedCPUAdam, FusedAdam), mapped to torch optimizers that
zerorun's runtime (and its CPU offload) steps; ``aio`` (AsyncIOBuilder), and
``__compatible_ops__``: which of DeepSpeed's compiled ops the layer stands in for (True) --
libraries probe it before using a feature (transformers' NVMe tests read ``async_io``)."""

from __future__ import annotations

import importlib
from typing import Any

from zerorun.compat.deepspeed._surface import module_getattr

__all__ = ["adam", "aio", "__compatible_ops__"]

# DeepSpeed's op names (op_builder NAME). True: the layer provides what the op is for; False: not
# provided (kernels zerorun has no counterpart for).
_PROVIDED = ("async_io", "cpu_adam", "fused_adam")
_NOT_PROVIDED = (
    "cpu_adagrad", "cpu_lion", "cutlass_ops", "dc", "deepspeed_ccl_comm", "deepspeed_not_implemented",
    "deepspeed_shm_comm", "evoformer_attn", "flash_attn", "fp_quantizer", "fused_lamb", "fused_lion", "gds",
    "inference_core_ops", "pack_bits", "quantizer", "ragged_device_ops", "ragged_ops", "random_ltd",
    "sparse_attn", "spatial_inference", "stochastic_transformer", "transformer", "transformer_inference",
)
__compatible_ops__: dict[str, bool] = {**dict.fromkeys(_NOT_PROVIDED, False), **dict.fromkeys(_PROVIDED, True)}

_missing = module_getattr(__name__)


def __getattr__(name: str) -> Any:
    if name in ("adam", "aio"):
        return importlib.import_module(f"{__name__}.{name}")
    return _missing(name)
