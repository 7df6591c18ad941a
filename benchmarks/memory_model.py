"""What zerorun should keep on each GPU: the ZeRO formulas of docs/architecture.md Contract 4.

Ψ = trainable parameters, N = data-parallel ranks. Mixed precision (bf16/fp16) with AdamW:

| stage | 16-bit params | gradients (fp32 default) | fp32 master | AdamW m, v |
|-------|---------------|--------------------------|-------------|------------|
| 0     | 2Ψ            | 4Ψ                       | 4Ψ          | 8Ψ         |
| 1     | 2Ψ            | 4Ψ                       | 4Ψ/N        | 8Ψ/N       |
| 2     | 2Ψ            | 4Ψ/N                     | 4Ψ/N        | 8Ψ/N       |
| 3     | 2Ψ/N          | 4Ψ/N                     | 4Ψ/N        | 8Ψ/N       |

(`communication_data_type: bf16` makes the gradient term 2 bytes: the paper's 2Ψ + 2Ψ + 12Ψ/N.)
Offload moves terms to the host, as DeepSpeed's estimators count it: `offload_optimizer` moves
master weights and optimizer states, and at stages 2–3 the gradient slices too (they are
copied to the host as they are reduced); `offload_param` (stage 3) moves the 16-bit slices.

Buffers are a separate term: `config_buffer_bytes` is the most the config lets zerorun hold
(an upper bound, the buckets may be transient); the check uses the buffers zerorun reports
(`reported_buffer_bytes`), while the measured side always comes from the allocator.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "model_state_bytes",
    "config_buffer_bytes",
    "reported_buffer_bytes",
    "grad_bytes_of",
    "deviation",
    "band_check",
]

_DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


def model_state_bytes(
    psi: int,
    n: int,
    stage: int,
    *,
    grad_bytes: int = 4,
    offload_optimizer: bool = False,
    offload_param: bool = False,
) -> dict[str, dict[str, float]]:
    """Model-state bytes per rank by term, {"gpu": {...}, "host": {...}}, mixed precision + AdamW."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0..3, got {stage}")
    if n < 1 or psi < 0:
        raise ValueError("need n >= 1 and psi >= 0")
    shard = float(psi) / n
    params = 2.0 * (shard if stage == 3 else psi)
    grads = grad_bytes * (shard if stage >= 2 else psi)
    master = 4.0 * (shard if stage >= 1 else psi)
    optim = 8.0 * (shard if stage >= 1 else psi)
    gpu = {"params": params, "grads": grads, "master": master, "optimizer": optim}
    host = {"params": 0.0, "grads": 0.0, "master": 0.0, "optimizer": 0.0}
    moved = []
    if offload_optimizer:
        moved += ["master", "optimizer"] + (["grads"] if stage >= 2 else [])
    if offload_param:
        if stage != 3:
            raise ValueError("offload_param needs stage 3")
        moved.append("params")
    for term in moved:
        host[term], gpu[term] = gpu[term], 0.0
    gpu["total"] = sum(gpu.values())
    host["total"] = sum(host.values())
    return {"gpu": gpu, "host": host}


def grad_bytes_of(ds_config: Mapping[str, Any]) -> int:
    """Bytes per gradient element: fp32 unless `communication_data_type` lowers it."""
    name = str(ds_config.get("communication_data_type") or "fp32").lower()
    return _DTYPE_BYTES.get(name, 4)


def config_buffer_bytes(ds_config: Mapping[str, Any]) -> dict[str, float]:
    """Upper bound of the GPU buffers the config sizes (DeepSpeed's defaults where unset)."""
    zero = ds_config.get("zero_optimization", {}) or {}
    stage = int(zero.get("stage", 0))
    gb = grad_bytes_of(ds_config)
    out: dict[str, float] = {"reduce_bucket": float(zero.get("reduce_bucket_size", 5e8)) * gb}
    if stage in (1, 2):
        out["allgather_bucket"] = float(zero.get("allgather_bucket_size", 5e8)) * 2
    if stage == 3:
        out["prefetch"] = float(zero.get("stage3_prefetch_bucket_size", 5e7)) * 2
        out["live_params"] = float(zero.get("stage3_max_live_parameters", 1e9)) * 2
    out["total"] = sum(out.values())
    return out


def _sum_numbers(value: Any) -> float:
    if isinstance(value, bool):
        return 0.0
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, Mapping):
        return sum(_sum_numbers(v) for v in value.values())
    return 0.0


def reported_buffer_bytes(report: Any, device_type: str = "cuda") -> float | None:
    """Communication-buffer bytes on `device_type` from `engine.memory_summary()`, or None.

    The summary is {device: {category: bytes}} (zerorun/runtime/memory.py), e.g.
    {"cuda:0": {"params": ..., "buffers": ...}}; a flat {"buffers": n} is also taken.
    """
    if not isinstance(report, Mapping):
        return None
    for key, section in report.items():
        if str(key).split(":")[0] == device_type and isinstance(section, Mapping):
            for k, v in section.items():
                if "buffer" in str(k).lower() and "module" not in str(k).lower():
                    return _sum_numbers(v)
    for k, v in report.items():
        if str(k).lower() == "buffers":
            return _sum_numbers(v)
    return None


def deviation(measured: float, expected: float) -> float:
    """Relative deviation of measured from expected ((m - e) / e)."""
    if expected <= 0:
        return float("inf") if measured > 0 else 0.0
    return (measured - expected) / expected


def band_check(measured: list[float], formula: float, buffers: float, tol: float = 0.05) -> dict[str, Any]:
    """Is each rank's measured memory within `tol` of [formula, formula + buffers]?

    The buffer term is an allowance: zerorun reports its buffers' peak, and they may or may not
    be alive at the measured point (staging buckets are freed after use). A rank is inside when
    formula·(1 − tol) ≤ measured ≤ (formula + buffers)·(1 + tol); its deviation is relative to
    the nearer end of the band (0 inside it), signed (negative = below the formula).
    """
    low, high = formula, formula + max(buffers, 0.0)
    devs = []
    for m in measured:
        if m < low:
            devs.append(deviation(m, low))
        elif m > high:
            devs.append(deviation(m, high))
        else:
            devs.append(0.0)
    return {
        "low": low,
        "high": high,
        "measured_per_rank": list(measured),
        "deviation_from_formula_per_rank": [deviation(m, formula) for m in measured],
        "deviation_from_band_per_rank": devs,
        "max_abs_deviation": max((abs(d) for d in devs), default=0.0),
        "within": all(abs(d) <= tol for d in devs),
    }
