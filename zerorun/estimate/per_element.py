"""Bytes per parameter element of each model-state term: the precision and optimizer policy
(Contract 4)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Optimizer state bytes per trainable element (fp32 states), by lower-case optimizer name.
_OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adam": 8, "adamw": 8, "fusedadam": 8, "cpuadam": 8, "deepspeedcpuadam": 8, "lamb": 8,
    "onebitadam": 8, "zerooneadam": 8, "onebitlamb": 8, "sparseadam": 8, "adamax": 8, "nadam": 8,
    "radam": 8, "adadelta": 8, "rprop": 8, "muadam": 8, "muadamw": 8,
    "adagrad": 4, "lion": 4, "asgd": 4, "muon": 4, "musgd": 4, "adafactor": 0,
}  # fmt: skip


def optimizer_state_bytes(name: str | None, params: Mapping[str, Any] | None = None) -> tuple[int, str | None]:
    """Bytes of optimizer state per element for an optimizer config -> (bytes, note or None).

    SGD keeps a momentum buffer only with momentum > 0; RMSprop adds one for momentum and one
    for `centered`; Adam-family `amsgrad` adds the running maximum.
    """
    params = dict(params or {})
    if name is None:
        return 8, "no optimizer in the config: Adam/AdamW assumed (8 bytes per element)"
    key = name.lower()
    if key == "sgd":
        momentum = params.get("momentum", 0)
        return (4 if isinstance(momentum, int | float) and momentum > 0 else 0), None
    if key == "rmsprop":
        extra = 4 if isinstance(params.get("momentum", 0), int | float) and params.get("momentum", 0) > 0 else 0
        return 4 + extra + (4 if params.get("centered") is True else 0), None
    if key in _OPTIMIZER_STATE_BYTES:
        base = _OPTIMIZER_STATE_BYTES[key]
        if params.get("amsgrad") is True and key in ("adam", "adamw"):
            base += 4
        note = None
        if key == "adafactor":
            note = "Adafactor keeps factored (row/column) states: counted as 0 bytes per element"
        if key == "muon":
            note = "Muon: 4 bytes (momentum) per element; its Adam-updated parameters need 8"
        return base, note
    return 8, f"optimizer {name!r}: state size unknown, 8 bytes per element (Adam) assumed"


@dataclass(frozen=True)
class BytesPerElement:
    """Bytes per parameter element of each term: the precision and optimizer policy."""

    params: int
    grads: int
    master: int
    optimizer_states: int
    precision: str  # "bf16", "fp16", "fp32" or "paper" (the ZeRO paper's 2 + 2 + 12)
    optimizer: str
    notes: tuple[str, ...] = ()

    @classmethod
    def paper(cls) -> BytesPerElement:
        """The ZeRO paper's model: mixed-precision Adam, 2Ψ + 2Ψ + KΨ with K = 12."""
        return cls(2, 2, 4, 8, precision="paper", optimizer="Adam")

    @classmethod
    def from_config(cls, config: Any) -> BytesPerElement:
        """Follow a config's precision, communication dtype and optimizer (Contract 4)."""
        notes: list[str] = []
        fp16, bf16 = config.fp16.enabled, config.bf16.enabled
        if fp16 is True or bf16 is True:
            precision = "fp16" if fp16 is True else "bf16"
        elif "auto" in (fp16, bf16):
            precision = "bf16" if bf16 == "auto" else "fp16"
            notes.append(f"{precision}.enabled is \"auto\": 16-bit mixed precision assumed")
        else:
            precision = "fp32"
        opt = config.optimizer
        state_bytes, note = optimizer_state_bytes(
            opt.canonical_type if opt is not None else None, opt.params if opt is not None else None
        )
        if note:
            notes.append(note)
        name = opt.canonical_type if opt is not None else "Adam (assumed)"
        if precision == "fp32":
            return cls(4, 4, 0, state_bytes, precision="fp32", optimizer=name, notes=tuple(notes))
        grads = 2 if config.communication_data_type in ("fp16", "bf16") else 4
        return cls(2, grads, 4, state_bytes, precision=precision, optimizer=name, notes=tuple(notes))

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer_states

