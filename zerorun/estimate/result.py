"""The estimate itself: per-rank bytes of each term by device, buffers, and the formulas that
render them ('2Ψ + 14Ψ/N')."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from zerorun.estimate.per_element import BytesPerElement

TERMS = ("params", "grads", "master", "optimizer_states")
DEVICES = ("gpu", "cpu", "nvme")
Offload = Literal["none", "cpu", "nvme"]
# One placed term: (term, device, bytes per element, partitioned i.e. ×Ψ/N rather than ×Ψ).
# Bytes per element are fractional with a partial offload (offload_optimizer.ratio).
Piece = tuple[str, str, float, bool]


@dataclass(frozen=True)
class Estimate:
    """Per-rank bytes of model states by device and term, plus buffers (upper bounds)."""

    num_params: int
    world_size: int
    stage: int
    offload_optimizer: Offload
    offload_param: Offload
    bytes_per_element: BytesPerElement
    terms: dict[str, dict[str, float]]  # device -> term -> bytes per rank
    buffers: dict[str, dict[str, float]] = field(default_factory=dict)  # device -> buffer -> bytes
    formulas: dict[str, str] = field(default_factory=dict)  # term -> "4Ψ/N on gpu + 4Ψ/N on cpu"
    notes: tuple[str, ...] = ()
    pieces: tuple[Piece, ...] = ()  # (term, device, bytes per element, partitioned)
    # Share of master + optimizer states (and of their step) on the host with optimizer offload
    # to cpu (offload_optimizer.ratio, "auto" resolved); 1.0: all of it.
    offload_ratio: float = 1.0

    def model_states(self, device: str) -> float:
        """Bytes of model states on `device` ("gpu", "cpu", "nvme") per rank at their peak:
        after the backward, when the gradients exist (Contract 4)."""
        return sum(self.terms.get(device, {}).values())

    def between_steps(self, device: str) -> float:
        """Bytes of model states on `device` between optimizer steps: the GPU's gradients exist
        only from the step's first gradient to the optimizer step (the host's fp32 gradient
        copies of an offloaded optimizer are kept)."""
        transient = self.terms.get(device, {}).get("grads", 0.0) if device == "gpu" else 0.0
        return self.model_states(device) - transient

    def buffer_bytes(self, device: str) -> float:
        return sum(self.buffers.get(device, {}).values())

    def total(self, device: str, *, with_buffers: bool = True) -> float:
        return self.model_states(device) + (self.buffer_bytes(device) if with_buffers else 0.0)

    def formula(self, device: str) -> str:
        """The model states on `device` as a formula: '2Ψ + 14Ψ/N' (replicated + partitioned)."""
        whole = sum(w for _, d, w, p in self.pieces if d == device and not p)
        part = sum(w for _, d, w, p in self.pieces if d == device and p)
        pieces = ([f"{_w(whole)}Ψ"] if whole else []) + ([f"{_w(part)}Ψ/N"] if part else [])
        return " + ".join(pieces) or "0"

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_params": self.num_params,
            "world_size": self.world_size,
            "stage": self.stage,
            "offload_optimizer": self.offload_optimizer,
            "offload_param": self.offload_param,
            "offload_ratio": self.offload_ratio,
            "precision": self.bytes_per_element.precision,
            "optimizer": self.bytes_per_element.optimizer,
            "bytes_per_element": {t: getattr(self.bytes_per_element, t) for t in TERMS},
            "per_rank": {
                d: {**self.terms.get(d, {}), "total": self.model_states(d)} for d in DEVICES
            },
            "point": "per_rank: after the backward (gradients alive, the peak of model states); "
            "between_steps_per_rank: after the optimizer step (GPU gradients freed)",
            "between_steps_per_rank": {d: self.between_steps(d) for d in DEVICES},
            "buffers_per_rank": {d: {**self.buffers.get(d, {}), "total": float(self.buffer_bytes(d))} for d in DEVICES},
            "formulas": dict(self.formulas),
            "formula_per_device": {d: self.formula(d) for d in DEVICES},
            "notes": list(self.notes),
            "activations": "not included",
        }


def _w(width: float) -> str:
    return f"{width:.3g}"
