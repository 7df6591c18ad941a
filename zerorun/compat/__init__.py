"""zerorun's DeepSpeed compatibility layer (docs/migration-from-deepspeed.md).

``zerorun --deepspeed-compat SCRIPT`` (or ``launcher: {deepspeed_compat: true}`` in the config)
makes ``import deepspeed`` in every rank resolve to ``zerorun.compat.deepspeed``: DeepSpeed's
API -- what DeepSpeed scripts and Hugging Face Trainer/accelerate use -- backed by zerorun's
runtime. ``activate()`` does the same inside one process. This package imports only the
standard library; the layer itself is imported when a script imports deepspeed.
"""

from __future__ import annotations

from zerorun.compat.activation import COMPAT_VERSION, ENV_VAR, activate, deactivate, is_active, real_deepspeed

__all__ = ["COMPAT_VERSION", "ENV_VAR", "activate", "deactivate", "is_active", "real_deepspeed"]
