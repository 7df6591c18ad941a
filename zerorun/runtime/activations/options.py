"""The `activation_checkpointing` section as one frozen object (read once from the config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerorun.config.schema import ZerorunConfig

__all__ = ["ActivationOptions"]


@dataclass(frozen=True)
class ActivationOptions:
    partition_activations: bool  # keep 1/N of each checkpointed input across the mpu's group
    cpu_checkpointing: bool  # keep checkpointed inputs in pinned host memory
    synchronize: bool  # synchronize_checkpoint_boundary: device sync around each checkpointed forward
    profile: bool  # time each checkpointed forward and recomputation (reported with steps_per_print)

    @classmethod
    def from_config(cls, cfg: ZerorunConfig) -> ActivationOptions:
        ac = cfg.activation_checkpointing
        return cls(
            partition_activations=ac.partition_activations,
            cpu_checkpointing=ac.cpu_checkpointing,
            synchronize=ac.synchronize_checkpoint_boundary,
            profile=ac.profile,
        )
