"""Sharded, reshardable, crash-safe checkpoints and streaming consolidation (docs/checkpoints.md).

One concept per module:
    format.py              the vocabulary (fragments) and the on-disk layout
    safetensors_stream.py  a safetensors writer that streams, a reader of element ranges
    store.py               one rank's shard file; reading any range from whichever files hold it
    atomic.py              temporary tag directory, fsync, rename, `latest`; crash injection
    rng.py                 per-rank RNG states and what a reshard does with them
    sharded.py             the collective save/load choreography over a `CheckpointView`
    engine_view.py         the `CheckpointView` of an Engine (Contract 6 -> Contract 7)
    consolidate.py         a full Hugging Face-layout state dict, one tensor at a time
    export.py              `engine.save_16bit_model` (any stage)
"""

from __future__ import annotations

from zerorun.runtime.checkpoint.consolidate import (
    ConsolidateResult,
    consolidate,
    get_fp32_state_dict,
    load_state_dict_from_checkpoint,
)
from zerorun.runtime.checkpoint.sharded import CheckpointView, load_checkpoint, save_checkpoint
from zerorun.runtime.checkpoint.store import CheckpointReader

__all__ = [
    "CheckpointReader",
    "CheckpointView",
    "ConsolidateResult",
    "consolidate",
    "get_fp32_state_dict",
    "load_checkpoint",
    "load_state_dict_from_checkpoint",
    "save_checkpoint",
]
