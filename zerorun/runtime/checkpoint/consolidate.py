"""A full state dict from a sharded checkpoint, streamed one tensor at a time.

Output is what plain PyTorch and Hugging Face loaders read: ``model.safetensors`` (or
``pytorch_model.bin``) when everything fits in one shard, else numbered shards plus
``model.safetensors.index.json`` / ``pytorch_model.bin.index.json`` (``weight_map`` and
``metadata.total_size``). Tied weights are written once, under the first name the module
registered (what ``named_parameters()`` yields and Hugging Face keeps); the aliases are listed
in the index's metadata as ``zerorun_tied``.

Memory: safetensors output holds one tensor at a time (the header with every offset is
computed from the metadata first, then tensors stream in); torch output holds one output
shard (``torch.save`` cannot stream) plus the tensor being read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from zerorun.errors import CheckpointError

from . import atomic
from .format import BUFFER, META_FILE, WEIGHT, CheckpointMeta, dtype_from_name
from .safetensors_stream import StreamWriter, TensorEntry
from .sharded import resolve_tag
from .store import CheckpointReader

__all__ = [
    "output_tensors",
    "plan_shards",
    "shard_names",
    "write_state_dict",
    "consolidate",
    "ConsolidateResult",
    "get_fp32_state_dict",
    "load_state_dict_from_checkpoint",
]

FORMATS = ("safetensors", "torch")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def plan_shards(tensors: Sequence[TensorEntry], max_shard_size: int) -> list[list[TensorEntry]]:
    """Greedy, in order (Hugging Face's rule): a new shard starts when the next tensor would
    push the current one past `max_shard_size`; a tensor larger than that gets its own shard."""
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards if shards[0] else []


def shard_names(fmt: str, n: int) -> tuple[list[str], str | None]:
    """File names for `n` shards, and the index file name (None for a single file)."""
    base, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    if n <= 1:
        return [f"{base}.{ext}"], None
    return [f"{base}-{i + 1:05d}-of-{n:05d}.{ext}" for i in range(n)], f"{base}.{ext}.index.json"


def write_state_dict(
    out_dir: Path,
    tensors: Sequence[TensorEntry],
    produce: Callable[[TensorEntry], torch.Tensor],
    *,
    fmt: str = "safetensors",
    max_shard_size: int = 5 * 10**9,
    tied: dict[str, str] | None = None,
    single_file: str | None = None,
    on_file: Callable[[Path, int], None] | None = None,
) -> list[Path]:
    """Write tensors (in order) to `out_dir`, calling `produce` for each exactly once, in order.

    `single_file` forces one file of that name (``save_16bit_model``'s behaviour). `on_file`
    is called with each finished file and its size in bytes (progress for long exports).
    """
    if fmt not in FORMATS:
        raise CheckpointError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = [list(tensors)] if single_file else plan_shards(tensors, max_shard_size)
    names, index_name = ([single_file], None) if single_file else shard_names(fmt, len(shards))
    written: list[Path] = []
    weight_map: dict[str, str] = {}
    for shard, fname in zip(shards, names, strict=True):
        path = out_dir / fname
        if fmt == "safetensors":
            with StreamWriter(path, shard, {"format": "pt"}) as w:
                for t in shard:
                    w.write(t.name, _checked(produce(t), t))
        else:
            sd = {t.name: _checked(produce(t), t).reshape(t.shape) for t in shard}
            with open(path, "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
            del sd
        written.append(path)
        weight_map.update({t.name: fname for t in shard})
        if on_file is not None:
            on_file(path, path.stat().st_size)
    if index_name is not None:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors), "zerorun_tied": dict(tied or {})},
            "weight_map": weight_map,
        }
        tmp = out_dir / f".{index_name}.tmp"
        tmp.write_text(json.dumps(index, indent=2))
        os.replace(tmp, out_dir / index_name)
        written.append(out_dir / index_name)
    atomic.fsync_dir(out_dir)
    return written


def _checked(t: torch.Tensor, spec: TensorEntry) -> torch.Tensor:
    if t.dtype != spec.dtype or t.numel() != spec.numel:
        raise CheckpointError(f"internal: tensor {spec.name!r} came out as {t.dtype} {list(t.shape)}")
    return t


_OUTPUT_PATTERNS = (
    "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
    "pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json",
)


def _clear_previous_output(out_dir: Path, overwrite: bool) -> None:
    """Leftovers of an earlier export would mislead loaders (an old index next to a new single
    file is what Hugging Face would load), so they are an error, or removed with `overwrite`."""
    old = sorted({p for pat in _OUTPUT_PATTERNS for p in out_dir.glob(pat)})
    if not old:
        return
    if not overwrite:
        raise CheckpointError(
            f"{out_dir} already holds model files ({', '.join(p.name for p in old[:4])}"
            f"{', ...' if len(old) > 4 else ''}); choose an empty directory or pass --overwrite"
        )
    for p in old:
        p.unlink()


@dataclass(frozen=True)
class ConsolidateResult:
    tag_dir: Path
    files: list[Path]
    num_tensors: int
    total_bytes: int
    tied: dict[str, str]


def _tag_dir(ckpt_dir: str | os.PathLike[str], tag: str | None) -> Path:
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory")
    if (root / META_FILE).is_file() and tag is None:
        return root
    resolved = resolve_tag(root, tag)
    if resolved is None:
        raise CheckpointError(
            f"{root} has no 'latest' file and is not a checkpoint tag directory; pass --tag "
            "or the tag directory itself"
        )
    return root / resolved


def output_tensors(meta: CheckpointMeta, dtype: torch.dtype | None) -> tuple[list[TensorEntry], dict[str, str]]:
    """The tensors of the model's state dict, in order: parameters then buffers, floating ones
    in ``dtype`` (None: the dtype they trained in); and each name's kind (weight or buffer)."""
    tensors: list[TensorEntry] = []
    kinds: dict[str, str] = {}
    for infos, kind in ((meta.params, WEIGHT), (meta.buffers, BUFFER)):
        for p in infos:
            trained = dtype_from_name(p.dtype)
            out = (dtype or trained) if trained.is_floating_point else trained
            tensors.append(TensorEntry(p.name, out, p.shape))
            kinds[p.name] = kind
    return tensors, kinds


def _output_tensors(meta: CheckpointMeta, dtype: str | None) -> tuple[list[TensorEntry], dict[str, str]]:
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    return output_tensors(meta, DTYPES[dtype] if dtype is not None else None)


def consolidate(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    dtype: str | None = "fp32",
    fmt: str = "safetensors",
    max_shard_size: int = 5 * 10**9,
    overwrite: bool = False,
    on_file: Callable[[Path, int], None] | None = None,
) -> ConsolidateResult:
    """Build a full state dict from a sharded checkpoint (see the module docstring).

    `ckpt_dir` may be the save directory (uses `latest` or `tag`) or a tag directory itself.
    `dtype`: fp32 | bf16 | fp16 for floating tensors, or None for the dtype the model trained
    in. Integer buffers keep their dtype. Model files already in `out_dir` are an error unless
    `overwrite` (then they are removed first).
    """
    tag_dir = _tag_dir(ckpt_dir, tag)
    with CheckpointReader(tag_dir) as reader:
        meta = reader.meta
        tensors, kinds = _output_tensors(meta, dtype)
        if Path(out_dir).is_dir():
            _clear_previous_output(Path(out_dir), overwrite)
        files = write_state_dict(
            Path(out_dir),
            tensors,
            lambda t: reader.read_full(t.name, kinds[t.name], dtype=t.dtype),
            fmt=fmt,
            max_shard_size=max_shard_size,
            tied=meta.tied,
            on_file=on_file,
        )
    return ConsolidateResult(tag_dir, files, len(tensors), sum(t.nbytes for t in tensors), dict(meta.tied))


def get_fp32_state_dict(
    ckpt_dir: str | os.PathLike[str], tag: str | None = None, *, dtype: str | None = "fp32"
) -> dict[str, torch.Tensor]:
    """The full state dict in memory (DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``),
    tied weights under every name sharing one tensor, so ``model.load_state_dict(sd)`` works
    strictly. Holds the whole model: for big models use `consolidate` (streams to files)."""
    with CheckpointReader(_tag_dir(ckpt_dir, tag)) as reader:
        tensors, kinds = _output_tensors(reader.meta, dtype)
        sd = {t.name: reader.read_full(t.name, kinds[t.name], dtype=t.dtype).reshape(t.shape) for t in tensors}
        for alias, canonical in reader.meta.tied.items():
            if canonical in sd:
                sd[alias] = sd[canonical]
    return sd


def load_state_dict_from_checkpoint(
    model: torch.nn.Module, ckpt_dir: str | os.PathLike[str], tag: str | None = None, *, strict: bool = True
) -> torch.nn.Module:
    """DeepSpeed's ``load_state_dict_from_zero_checkpoint``: a plain (non-engine) model gets the
    checkpoint's fp32 weights, e.g. for evaluation or export after training."""
    sd = get_fp32_state_dict(ckpt_dir, tag)
    with torch.no_grad():
        model.load_state_dict(sd, strict=strict)
    return model
