"""What zerorun should keep on each GPU: the ZeRO formulas of docs/architecture.md Contract 4.

The formulas are `zerorun.estimate`'s (one memory model, one place); this module adapts them
to the benchmark's records. Ψ = trainable parameters, N = data-parallel ranks. Mixed precision
(bf16/fp16) with AdamW, after the backward (gradients alive):

| stage | 16-bit params | gradients (fp32 default) | fp32 master | AdamW m, v | between steps |
|-------|---------------|--------------------------|-------------|------------|---------------|
| 0     | 2Ψ            | 4Ψ                       | 4Ψ          | 8Ψ         | 14Ψ           |
| 1     | 2Ψ            | 4Ψ                       | 4Ψ/N        | 8Ψ/N       | 2Ψ + 12Ψ/N    |
| 2     | 2Ψ            | 4Ψ/N                     | 4Ψ/N        | 8Ψ/N       | 2Ψ + 12Ψ/N    |
| 3     | 0 (the master slice is the parameter) | 4Ψ/N | 4Ψ/N     | 8Ψ/N       | 12Ψ/N         |

(`communication_data_type: bf16` makes the GPU gradient term 2 bytes.) `offload_optimizer`
moves master weights and optimizer states to the host and adds the CPU step's fp32 host copy of
the gradient slices (the GPU keeps its gradients until the step); `offload_param` (stage 3)
moves the 16-bit slices, which exist with any offload.

The check is not circular: the estimator is arithmetic from the config, and the measured side
always comes from the allocator (CUDA) or a census of live tensors (CPU), never from zerorun's
own report. Buffers are a separate term, also from the config alone: `config_buffer_bytes` is
the most the config lets zerorun hold (an upper bound, the buckets may be transient); the band's
upper edge is formula + that. What zerorun reports about its buffers (`reported_buffer_bytes`)
is recorded beside it, never used in the check.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zerorun import estimate

__all__ = [
    "model_state_bytes",
    "config_buffer_bytes",
    "reported_buffer_bytes",
    "grad_bytes_of",
    "deviation",
    "band_check",
]

_DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
# The benchmark's own names for the estimator's terms and devices.
_TERMS = {"params": "params", "grads": "grads", "master": "master", "optimizer": "optimizer_states"}


def model_state_bytes(
    psi: int,
    n: int,
    stage: int,
    *,
    grad_bytes: int = 4,
    offload_optimizer: bool = False,
    offload_param: bool = False,
) -> dict[str, dict[str, float]]:
    """Model-state bytes per rank, {"gpu": {...}, "host": {...}}, mixed precision + AdamW.

    Each side has the four terms, "total" (after the backward: the checked point) and
    "between_steps" (after the optimizer step: the GPU's gradients are freed).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0..3, got {stage}")
    if n < 1 or psi < 0:
        raise ValueError("need n >= 1 and psi >= 0")
    if offload_param and stage != 3:
        raise ValueError("offload_param needs stage 3")
    bpe = estimate.BytesPerElement(2, grad_bytes, 4, 8, precision="bf16", optimizer="AdamW")
    est = estimate.model_state_bytes(
        psi,
        n,
        stage=stage,
        offload_optimizer="cpu" if offload_optimizer and stage >= 1 else "none",
        offload_param="cpu" if offload_param else "none",
        bytes_per_element=bpe,
    )
    out: dict[str, dict[str, float]] = {}
    for side, device in (("gpu", "gpu"), ("host", "cpu")):
        terms = {mine: est.terms[device][theirs] for mine, theirs in _TERMS.items()}
        out[side] = {**terms, "total": est.model_states(device), "between_steps": est.between_steps(device)}
    return out


def grad_bytes_of(ds_config: Mapping[str, Any]) -> int:
    """Bytes per gradient element: fp32 unless `communication_data_type` lowers it."""
    name = str(ds_config.get("communication_data_type") or "fp32").lower()
    return _DTYPE_BYTES.get(name, 4)


def config_buffer_bytes(ds_config: Mapping[str, Any], psi: int, n: int = 1) -> dict[str, float]:
    """Upper bound of the GPU buffers the config sizes for Ψ = `psi` on `n` ranks (DeepSpeed's
    defaults where unset): `zerorun.estimate`'s buffer terms, plus "total"."""
    out = dict(estimate.model_state_bytes(psi, n, dict(ds_config)).buffers["gpu"])
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
