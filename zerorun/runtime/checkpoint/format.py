"""The on-disk layout of a zerorun checkpoint, and the vocabulary used to describe it.

[Note: checkpoint fragments]
A *fragment* is a contiguous element range [start, end) of one parameter's flattened tensor,
for one *kind* of state:
  - ``weight``: the parameter's most precise values: the fp32 master where training is mixed
    precision, the parameter itself otherwise (16-bit copies are a cast of it, so they are not
    stored twice);
  - ``buffer``: a module buffer that is part of ``state_dict()`` (replicated; rank 0's values
    are the ones written, see `owned_pieces`);
  - ``optim.<key>``: an elementwise optimizer state tensor (``optim.exp_avg``, ...).
Each rank writes the fragments it owns. At ZeRO stages 1-3 a rank's slice of a flat buffer
crosses parameter boundaries, so it owns pieces of several parameters; a *replicated* tensor
(every rank holds all of it) is split evenly and each rank writes its piece, so nothing is
stored twice and writing is spread over ranks. Because every fragment records its parameter
and range, any rank layout (world size, stage) can be read back from any other.

Layout (DeepSpeed's names where tools rely on them: Hugging Face Trainer looks for
``global_step*`` directories and the ``latest`` file)::

    SAVE_DIR/latest                       text: the newest complete tag
    SAVE_DIR/global_step{N}/              one checkpoint (a *tag*)
        zerorun_checkpoint.json           metadata (CheckpointMeta), written by rank 0
        engine_state.pt                   scheduler, loss scaler, client_state (rank 0)
        shard_rank{r:05d}.safetensors     rank r's fragments (+ their index in __metadata__)
        rng_rank{r:05d}.pt                rank r's RNG states
    SAVE_DIR/.tmp-{tag}/                  a save in progress (never picked by a lookup)
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from zerorun.errors import CheckpointError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "META_FILE",
    "ENGINE_STATE_FILE",
    "LATEST_FILE",
    "TMP_PREFIX",
    "WEIGHT",
    "BUFFER",
    "OPTIM_PREFIX",
    "Fragment",
    "FragmentRecord",
    "ParamInfo",
    "CheckpointMeta",
    "shard_file",
    "rng_file",
    "even_chunk",
    "owned_pieces",
    "dtype_name",
    "dtype_from_name",
    "encode_fragment_index",
    "decode_fragment_index",
]

FORMAT_NAME = "zerorun-checkpoint"
FORMAT_VERSION = 1
META_FILE = "zerorun_checkpoint.json"
ENGINE_STATE_FILE = "engine_state.pt"
LATEST_FILE = "latest"
TMP_PREFIX = ".tmp-"
FRAGMENT_INDEX_KEY = "zerorun.fragments"

WEIGHT = "weight"
BUFFER = "buffer"
OPTIM_PREFIX = "optim."


def shard_file(rank: int) -> str:
    return f"shard_rank{rank:05d}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.pt"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


@dataclass(frozen=True)
class Fragment:
    """A live piece of state a rank holds (see [Note: checkpoint fragments]).

    ``tensor`` is a 1-D view of ``end - start`` elements, or, when ``replicated``, the whole
    flattened tensor (start=0, end=numel). Saving reads it; loading copies into it, so it must
    be a view into the engine's real storage.
    """

    name: str
    kind: str
    start: int
    end: int
    tensor: torch.Tensor
    replicated: bool = False


@dataclass(frozen=True)
class FragmentRecord:
    """A fragment as stored: where its elements are (file, tensor key), not the elements."""

    name: str
    kind: str
    start: int
    end: int
    file: str
    key: str


def even_chunk(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """The [start, end) piece of a replicated tensor that `rank` writes (ceil-sized chunks)."""
    size = -(-numel // world_size) if numel else 0
    start = min(numel, rank * size)
    return start, min(numel, start + size)


def owned_pieces(fragments: Iterable[Fragment], rank: int, world_size: int) -> list[tuple[Fragment, int, int]]:
    """What this rank writes: (fragment, start, end) with replicated tensors cut to its chunk.

    Buffers are the exception: ranks may hold different values (BatchNorm statistics without
    SyncBatchNorm), and a patchwork of ranks' chunks would match none of them, so rank 0
    writes every buffer whole (DeepSpeed saves rank 0's module state too). Empty ranges are
    dropped. Ranges are absolute (in the parameter's flattened tensor).
    """
    out: list[tuple[Fragment, int, int]] = []
    for f in fragments:
        if f.replicated and f.kind == BUFFER:
            s, e = (f.start, f.end) if rank == 0 else (f.start, f.start)
        elif f.replicated:
            s, e = even_chunk(f.end - f.start, rank, world_size)
            s, e = f.start + s, f.start + e
        else:
            s, e = f.start, f.end
        if e > s:
            out.append((f, s, e))
    return out


def encode_fragment_index(records: Iterable[FragmentRecord]) -> str:
    return json.dumps([[r.key, r.name, r.kind, r.start, r.end] for r in records], separators=(",", ":"))


def decode_fragment_index(text: str, file: str) -> list[FragmentRecord]:
    try:
        rows = json.loads(text)
        return [FragmentRecord(name, kind, int(s), int(e), file, key) for key, name, kind, s, e in rows]
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{file}: corrupt fragment index ({err})") from err


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # the dtype the model trains in (bfloat16 / float16 / float32)
    requires_grad: bool = True

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class CheckpointMeta:
    """Everything about a checkpoint except the tensors; stored as JSON by rank 0."""

    world_size: int
    stage: int
    precision: str  # fp32 | bf16 | fp16
    params: list[ParamInfo]
    buffers: list[ParamInfo] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)  # alias name -> name stored
    optimizer: dict[str, Any] = field(default_factory=dict)  # class, param_groups, scalar_state
    counters: dict[str, int] = field(default_factory=dict)  # global_steps, global_samples, ...
    kinds: list[str] = field(default_factory=list)
    zerorun_version: str = ""
    tag: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        d = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "zerorun_version": self.zerorun_version,
            "tag": self.tag,
            "world_size": self.world_size,
            "stage": self.stage,
            "precision": self.precision,
            "params": [_info_json(p) for p in self.params],
            "buffers": [_info_json(b) for b in self.buffers],
            "tied": self.tied,
            "optimizer": self.optimizer,
            "counters": self.counters,
            "kinds": self.kinds,
            "files": {
                "shards": [shard_file(r) for r in range(self.world_size)],
                "rng": [rng_file(r) for r in range(self.world_size)],
            },
            "extra": self.extra,
        }
        return _dump_readable(d)

    @classmethod
    def from_json(cls, text: str, path: str) -> CheckpointMeta:
        try:
            d = json.loads(text)
        except ValueError as err:
            raise CheckpointError(f"{path}: not valid JSON ({err})") from err
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{path}: not a zerorun checkpoint")
        if d.get("format_version", 0) > FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: checkpoint format version {d['format_version']} is newer than this zerorun "
                f"understands ({FORMAT_VERSION}); upgrade zerorun (saved by {d.get('zerorun_version')})"
            )
        try:
            return cls(
                world_size=int(d["world_size"]),
                stage=int(d["stage"]),
                precision=str(d["precision"]),
                params=[_info_from(p) for p in d["params"]],
                buffers=[_info_from(b) for b in d.get("buffers", [])],
                tied=dict(d.get("tied", {})),
                optimizer=dict(d.get("optimizer", {})),
                counters={k: int(v) for k, v in d.get("counters", {}).items()},
                kinds=list(d.get("kinds", [])),
                zerorun_version=str(d.get("zerorun_version", "")),
                tag=str(d.get("tag", "")),
                extra=dict(d.get("extra", {})),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: incomplete checkpoint metadata ({err!r})") from err


def _dump_readable(d: dict[str, Any]) -> str:
    """JSON with one top-level key per line and one parameter per line (``indent`` would put
    every dimension of every shape on its own line)."""
    parts = []
    for k, v in d.items():
        if isinstance(v, list) and v and isinstance(v[0], dict):
            rows = ",\n  ".join(json.dumps(x) for x in v)
            parts.append(f" {json.dumps(k)}: [\n  {rows}\n ]")
        else:
            parts.append(f" {json.dumps(k)}: {json.dumps(v)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def _info_json(p: ParamInfo) -> dict[str, Any]:
    return {"name": p.name, "shape": list(p.shape), "dtype": p.dtype, "requires_grad": p.requires_grad}


def _info_from(d: dict[str, Any]) -> ParamInfo:
    return ParamInfo(d["name"], tuple(int(s) for s in d["shape"]), str(d["dtype"]), bool(d.get("requires_grad", True)))
