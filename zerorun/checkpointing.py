"""Activation checkpointing, DeepSpeed's API (`deepspeed.checkpointing`), for Megatron-style scripts:

    import zerorun.checkpointing as checkpointing
    checkpointing.configure(mpu, deepspeed_config="ds.json")   # optional: initialize reads the config
    hidden = checkpointing.checkpoint(block, hidden, mask)

The config's `activation_checkpointing` section decides where checkpointed activations live:
`cpu_checkpointing` (pinned host memory, copied on a side stream and prefetched back one block
ahead), `partition_activations` (1/N per rank of the mpu's model-parallel group). docs/observability.md.
"""

from __future__ import annotations

from zerorun.runtime.activations import checkpoint, configure, is_configured, reset

__all__ = ["checkpoint", "configure", "is_configured", "reset"]
