"""Activation checkpointing (`activation_checkpointing` config section; the public API is
`zerorun.checkpointing`, and `deepspeed.checkpointing` in the compatibility layer)."""

from __future__ import annotations

from zerorun.runtime.activations.checkpoint import (
    checkpoint,
    configure,
    configure_from_options,
    current,
    is_configured,
    reset,
    take_profile,
)
from zerorun.runtime.activations.options import ActivationOptions

__all__ = [
    "ActivationOptions",
    "checkpoint",
    "configure",
    "configure_from_options",
    "current",
    "is_configured",
    "reset",
    "take_profile",
]
