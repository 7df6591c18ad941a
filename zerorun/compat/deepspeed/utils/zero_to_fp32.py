"""``deepspeed.utils.zero_to_fp32``: full fp32 weights from a checkpoint, after training.

zerorun's checkpoints keep DeepSpeed's directory layout (``global_step{N}/`` + ``latest``) in
zerorun's shard format; these are DeepSpeed's three entry points over zerorun's consolidation
(runtime/checkpoint/consolidate.py, also ``zerorun consolidate``). ``checkpoint_dir`` is the
directory holding ``latest`` (e.g. a Trainer's ``checkpoint-500``), or a tag directory.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zerorun.compat.deepspeed._surface import module_getattr, unsupported

__all__ = [
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "convert_zero_checkpoint_to_fp32_state_dict",
]

__getattr__ = module_getattr(__name__)


def _no_frozen_filter(exclude_frozen_parameters: bool, lazy_mode: bool = False) -> None:
    if exclude_frozen_parameters:
        unsupported("zero_to_fp32(exclude_frozen_parameters=True)", "zerorun's checkpoints do not record which parameters were frozen")
    if lazy_mode:
        unsupported("zero_to_fp32(lazy_mode=True)", "use convert_zero_checkpoint_to_fp32_state_dict, which streams to files")


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str], tag: str | None = None, exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """The whole model in fp32, in memory (tied weights under every name)."""
    _no_frozen_filter(exclude_frozen_parameters, lazy_mode)
    from zerorun.runtime.checkpoint.consolidate import get_fp32_state_dict

    return get_fp32_state_dict(checkpoint_dir, tag)


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> torch.nn.Module:
    """Load the checkpoint's fp32 weights into a plain (non-engine) ``model``; returns it. As in
    DeepSpeed, keys the model lacks or has in addition are tolerated (``strict=False``)."""
    from zerorun.runtime.checkpoint.consolidate import load_state_dict_from_checkpoint

    return load_state_dict_from_checkpoint(model, checkpoint_dir, tag, strict=False)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> Any:
    """Write the fp32 weights to ``output_dir`` in Hugging Face's layout (one file, or shards
    with an index), streaming one tensor at a time for safetensors."""
    _no_frozen_filter(exclude_frozen_parameters)
    from zerorun.runtime.checkpoint.consolidate import consolidate

    if isinstance(max_shard_size, str):
        from zerorun.sizes import parse_size

        max_shard_size = parse_size(max_shard_size)
    return consolidate(
        checkpoint_dir,
        output_dir,
        tag=tag,
        dtype="fp32",
        fmt="safetensors" if safe_serialization else "torch",
        max_shard_size=max_shard_size,
        overwrite=True,
    )
