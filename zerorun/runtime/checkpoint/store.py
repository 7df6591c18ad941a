"""Writing one rank's fragments, and reading any element range back from whichever files hold it.

Writing streams one fragment at a time through `StreamWriter` (memory: one fragment, plus a
device->host copy of it). Reading opens only the safetensors headers of the rank files (a
fragment index lives in each header's ``__metadata__``) and then reads exactly the byte
ranges asked for, keeping at most `_MAX_OPEN` files open: loading a checkpoint saved by 1024
ranks neither loads 1024 files into memory nor holds 1024 descriptors.
"""

from __future__ import annotations

import bisect
import os
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from zerorun.errors import CheckpointError

from .format import (
    FRAGMENT_INDEX_KEY,
    META_FILE,
    WEIGHT,
    CheckpointMeta,
    Fragment,
    FragmentRecord,
    decode_fragment_index,
    encode_fragment_index,
    owned_pieces,
    shard_file,
)
from .safetensors_stream import SafetensorsReader, StreamWriter, TensorEntry

__all__ = ["write_rank_shard", "CheckpointReader", "covering"]

_MAX_OPEN = 16


def write_rank_shard(
    directory: Path,
    rank: int,
    world_size: int,
    fragments: Iterable[Fragment],
    *,
    on_half_written: Callable[[], None] | None = None,
) -> list[FragmentRecord]:
    """Write the pieces this rank owns to ``directory/shard_rank{rank}.safetensors`` (fsynced).

    `on_half_written` runs after half of the pieces are written (the crash-injection hook).
    """
    pieces = owned_pieces(fragments, rank, world_size)
    fname = shard_file(rank)
    records: list[FragmentRecord] = []
    entries: list[TensorEntry] = []
    for f, s, e in pieces:
        key = f"{f.kind}/{f.name}[{s}:{e}]"
        records.append(FragmentRecord(f.name, f.kind, s, e, fname, key))
        entries.append(TensorEntry(key, f.tensor.dtype, (e - s,)))
    metadata = {"format": "pt", FRAGMENT_INDEX_KEY: encode_fragment_index(records)}
    half = len(pieces) // 2
    with StreamWriter(directory / fname, entries, metadata) as w:
        for i, ((f, s, e), entry) in enumerate(zip(pieces, entries, strict=True)):
            if i == half and on_half_written is not None:
                on_half_written()
            off = s - f.start
            w.write(entry.name, f.tensor.reshape(-1)[off : off + (e - s)])
    return records


def covering(
    records: list[FragmentRecord], starts: list[int], start: int, end: int
) -> tuple[list[tuple[FragmentRecord, int, int]], int]:
    """The reshard plan for one range (pure): which stored fragments hold elements [start, end)
    of one tensor, as (record, lo, hi) absolute ranges in order, each element taken once (from
    the first record that has it). `records` are sorted by start, `starts` their starts.
    Returns (pieces, covered): covered < end means [covered, end) is stored nowhere."""
    pieces: list[tuple[FragmentRecord, int, int]] = []
    covered = start
    i = max(0, bisect.bisect_right(starts, start) - 1)
    while covered < end and i < len(records):
        rec = records[i]
        i += 1
        if rec.end <= covered:
            continue
        if rec.start > covered:
            break
        hi = min(end, rec.end)
        pieces.append((rec, covered, hi))
        covered = hi
    return pieces, covered


class CheckpointReader:
    """Read fragments of a checkpoint tag directory by (parameter name, kind, element range)."""

    def __init__(self, tag_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(tag_dir)
        meta_path = self.dir / META_FILE
        try:
            text = meta_path.read_text()
        except FileNotFoundError:
            if any(self.dir.glob("*model_states.pt")):
                raise CheckpointError(
                    f"{self.dir} is a DeepSpeed checkpoint, not a zerorun one: convert it with DeepSpeed's "
                    "zero_to_fp32.py, then load the weights into the model before zerorun.initialize"
                ) from None
            raise CheckpointError(
                f"{self.dir} is not a complete zerorun checkpoint ({META_FILE} is missing)"
            ) from None
        self.meta = CheckpointMeta.from_json(text, str(meta_path))
        missing = [shard_file(r) for r in range(self.meta.world_size) if not (self.dir / shard_file(r)).is_file()]
        if missing:
            raise CheckpointError(
                f"{self.dir}: checkpoint saved by {self.meta.world_size} ranks is missing {len(missing)} "
                f"shard file(s) ({', '.join(missing[:4])}); was it copied partially, or saved to a "
                "directory that is not shared between nodes?"
            )
        # (name, kind) -> records sorted by start; parallel list of starts for bisect
        self._index: dict[tuple[str, str], list[FragmentRecord]] = defaultdict(list)
        # Every header is parsed once and kept (small); descriptors are opened on demand.
        self._readers: dict[str, SafetensorsReader] = {}
        for r in range(self.meta.world_size):
            rd = SafetensorsReader(self.dir / shard_file(r))
            rd.close()
            self._readers[shard_file(r)] = rd
            index_text = rd.metadata.get(FRAGMENT_INDEX_KEY)
            if index_text is None:
                raise CheckpointError(f"{rd.path}: no fragment index (not written by zerorun?)")
            for rec in decode_fragment_index(index_text, shard_file(r)):
                self._index[(rec.name, rec.kind)].append(rec)
        self._starts: dict[tuple[str, str], list[int]] = {}
        for k, recs in self._index.items():
            recs.sort(key=lambda x: x.start)
            self._starts[k] = [x.start for x in recs]
        self._open: OrderedDict[str, None] = OrderedDict()  # files with an open descriptor, LRU
        self.params = {p.name: p for p in self.meta.params}
        self.buffers = {b.name: b for b in self.meta.buffers}

    def kinds(self) -> set[str]:
        return {k for _, k in self._index}

    def has(self, name: str, kind: str) -> bool:
        return (name, kind) in self._index

    def numel(self, name: str) -> int:
        info = self.params.get(name) or self.buffers.get(name)
        if info is None:
            raise CheckpointError(f"{self.dir}: no parameter or buffer {name!r} in the checkpoint")
        return info.numel

    def _reader(self, file: str) -> SafetensorsReader:
        if file in self._open:
            self._open.move_to_end(file)
        else:
            if len(self._open) >= _MAX_OPEN:
                old, _ = self._open.popitem(last=False)
                self._readers[old].close()
            self._open[file] = None
        return self._readers[file]  # reopens its descriptor on the next read

    def read_into(self, name: str, kind: str, start: int, end: int, out: torch.Tensor) -> None:
        """Fill ``out`` (``end - start`` elements, any dtype/device) with elements [start, end)
        of `name`'s flattened `kind` tensor, from whichever rank files hold them."""
        key = (name, kind)
        recs = self._index.get(key)
        if recs is None:
            raise CheckpointError(f"{self.dir}: checkpoint has no {kind!r} state for {name!r}")
        if out.numel() != end - start:
            raise CheckpointError(f"destination for {name!r} has {out.numel()} elements, range has {end - start}")
        # Read straight into `out` when it is plain CPU memory; otherwise stage through host.
        staged = out.device.type != "cpu" or not out.is_contiguous()
        dest = torch.empty(end - start, dtype=out.dtype) if staged else out.view(-1)
        pieces, covered = covering(recs, self._starts[key], start, end)
        if covered < end:
            raise CheckpointError(
                f"{self.dir}: elements [{covered}, {end}) of {kind!r} for {name!r} are in no shard file "
                "(checkpoint incomplete or corrupt)"
            )
        for rec, lo, hi in pieces:
            self._reader(rec.file).read(rec.key, lo - rec.start, hi - rec.start, out=dest[lo - start : hi - start])
        if staged:
            out.copy_(dest.view(out.shape))

    def read_full(self, name: str, kind: str = WEIGHT, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole flattened tensor (1-D), in `dtype` or the stored dtype."""
        recs = self._index.get((name, kind))
        if recs is None:
            raise CheckpointError(f"{self.dir}: checkpoint has no {kind!r} state for {name!r}")
        n = self.numel(name)
        stored = self._reader(recs[0].file).dtype(recs[0].key)
        out = torch.empty(n, dtype=dtype or stored)
        self.read_into(name, kind, 0, n, out)
        return out

    def close(self) -> None:
        for rd in self._readers.values():
            rd.close()
        self._open.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
