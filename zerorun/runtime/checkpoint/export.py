"""`engine.save_16bit_model`: the full model written from inside training.

Works at every stage through the same fragment view checkpoints use: for each tensor, every
rank puts the pieces it owns into a zero buffer of the full size and a SUM-reduce to rank 0
assembles it (each element is owned by exactly one rank: replicated tensors are cut with the
same rule as in checkpoints). Memory: one full tensor per rank at a time, never the model;
rank 0 streams it to the file (safetensors) or collects the state dict (torch format, which
cannot stream — as DeepSpeed's ``pytorch_model.bin``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from zerorun.errors import CheckpointError

from .consolidate import output_tensors, write_state_dict
from .format import BUFFER, WEIGHT, Fragment, owned_pieces
from .safetensors_stream import TensorEntry

__all__ = ["save_full_model"]


def save_full_model(
    view: Any,
    save_dir: str | os.PathLike[str],
    save_filename: str = "pytorch_model.bin",
    *,
    dtype: torch.dtype | None = None,
) -> Path | None:
    """Collective. Rank 0 writes ``save_dir/save_filename`` (safetensors if the name ends in
    ``.safetensors``, else ``torch.save``) with every parameter and buffer in `dtype` (default:
    the dtype the model trains in); returns the path on rank 0, None elsewhere.

    In the torch format tied weights appear under every name (sharing one storage, like
    ``module.state_dict()``), so ``load_state_dict(strict=True)`` works; safetensors cannot
    share storage, so there they are written once (Hugging Face's convention).
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and view.world_size > 1
    group = view.process_group
    on_gloo = distributed and str(dist.get_backend(group)) == "gloo"
    rank, world = view.rank, view.world_size
    meta = view.checkpoint_meta()
    by_name: dict[tuple[str, str], list[tuple[Fragment, int, int]]] = {}
    for f, s, e in owned_pieces(view.checkpoint_fragments(for_load=False), rank, world):
        if f.kind in (WEIGHT, BUFFER):
            by_name.setdefault((f.name, f.kind), []).append((f, s, e))
    fmt = "safetensors" if save_filename.endswith(".safetensors") else "torch"
    tensors, kinds = output_tensors(meta, dtype)

    def assemble(t: TensorEntry) -> torch.Tensor:
        pieces = by_name.get((t.name, kinds[t.name]), [])
        src_dtype = pieces[0][0].tensor.dtype if pieces else t.dtype
        # one dtype on every rank for the reduce: fp32 for floating tensors (exact for 16-bit
        # values; elements are summed with zeros only)
        work = torch.float32 if t.dtype.is_floating_point or src_dtype.is_floating_point else torch.int64
        device = pieces[0][0].tensor.device if pieces else _device(view)
        if on_gloo:  # gloo's CUDA support is partial (ranks sharing a GPU use gloo): reduce on host
            device = torch.device("cpu")
        full = torch.zeros(t.numel, dtype=work, device=device)
        for f, s, e in pieces:
            full[s:e].copy_(f.tensor.reshape(-1)[s - f.start : e - f.start])
        if distributed:
            dist.reduce(full, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        return full.to("cpu", t.dtype)

    if rank != 0:
        for t in tensors:
            assemble(t)
        return None
    path = Path(save_dir) / save_filename
    if fmt == "safetensors":
        write_state_dict(Path(save_dir), tensors, assemble, fmt=fmt, single_file=save_filename)
        return path
    sd: dict[str, torch.Tensor] = {}
    for t in tensors:
        sd[t.name] = assemble(t).reshape(t.shape)
    for alias, canonical in meta.tied.items():
        sd[alias] = sd[canonical]
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{save_filename}.tmp")
    try:
        with open(tmp, "wb") as fh:
            torch.save(sd, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        raise CheckpointError(f"cannot write {path}: {err.strerror}") from err
    return path


def _device(view: Any) -> torch.device:
    dev = getattr(view, "device", None)
    return torch.device(dev) if dev is not None else torch.device("cpu")
