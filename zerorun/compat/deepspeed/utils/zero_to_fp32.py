"""``deepspeed.utils.zero_to_fp32``: full fp32 weights from a checkpoint, after training.

zerorun's checkpoints keep DeepSpeed's directory layout (``global_step{N}/`` + ``latest``) in
zerorun's shard format; these are DeepSpeed's three entry points over zerorun's consolidation
(runtime/checkpoint/consolidate.py, also ``zerorun consolidate``). ``checkpoint_dir`` is the
directory holding ``latest`` (e.g. a Trainer's ``checkpoint-500``), or a tag directory. A tag that
holds only DeepSpeed's files (written by DeepSpeed itself, before the switch to zerorun) is read
in DeepSpeed's layout (runtime/checkpoint/deepspeed_read.read_fp32_state_dict).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from zerorun.compat.deepspeed._surface import module_getattr, unsupported

__all__ = [
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "convert_zero_checkpoint_to_fp32_state_dict",
]

__getattr__ = module_getattr(__name__)


def _deepspeed_only_tag(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> Path | None:
    """The tag directory when it holds DeepSpeed's files and none of zerorun's, else None."""
    from zerorun.runtime.checkpoint.format import LATEST_FILE, META_FILE

    root = Path(checkpoint_dir)
    if tag is not None:
        tag_dir = root / tag
    elif (root / LATEST_FILE).is_file():
        tag_dir = root / (root / LATEST_FILE).read_text().strip()
    else:
        tag_dir = root
    if (tag_dir / META_FILE).is_file() or not any(tag_dir.glob("*_model_states.pt")):
        return None
    return tag_dir


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

    deepspeed_tag = _deepspeed_only_tag(checkpoint_dir, tag)
    if deepspeed_tag is not None:
        from zerorun.runtime.checkpoint.deepspeed_read import read_fp32_state_dict

        return read_fp32_state_dict(deepspeed_tag)
    return get_fp32_state_dict(checkpoint_dir, tag)


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> torch.nn.Module:
    """Load the checkpoint's fp32 weights into a plain (non-engine) ``model``; returns it. As in
    DeepSpeed, keys the model lacks or has in addition are tolerated (``strict=False``)."""
    from zerorun.runtime.checkpoint.consolidate import load_state_dict_from_checkpoint

    if _deepspeed_only_tag(checkpoint_dir, tag) is not None:
        model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=False)
        return model
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

    if _deepspeed_only_tag(checkpoint_dir, tag) is not None:
        unsupported(
            "convert_zero_checkpoint_to_fp32_state_dict on a checkpoint with DeepSpeed's files only",
            "get_fp32_state_dict_from_zero_checkpoint reads it (in memory); save that, or DeepSpeed's own zero_to_fp32.py",
        )

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
