"""A safetensors writer that streams, and a reader that reads element ranges.

Neither `torch.save` nor the safetensors library writes incrementally: both want the whole
state dict in memory. The format makes streaming possible because its header (8-byte
little-endian length, then JSON with every tensor's dtype, shape and byte offsets) comes
first and holds all offsets: the writer takes the list of (name, dtype, shape) up front,
writes the header, then accepts tensors one at a time in that order. Memory: one tensor.

The reader parses only the header and reads the bytes of the element range asked for with
`readinto` straight into the destination tensor (no mmap: mapped pages would count towards
RSS and make the consolidation's memory bound meaningless).

Files written here load with the safetensors library (and Hugging Face loaders, which need
`__metadata__["format"] == "pt"`; the writer sets it).
"""

from __future__ import annotations

import io
import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import torch

from zerorun.errors import CheckpointError

__all__ = [
    "TensorEntry",
    "StreamWriter",
    "SafetensorsReader",
    "DTYPE_TO_ST",
    "ST_TO_DTYPE",
    "file_size",
]

DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
ST_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_ST.items()}

_ALIGN = 8  # the header is padded with spaces so tensor data starts 8-byte aligned


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file-to-be: its name, dtype and shape (sizes are computed up front)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _header_bytes(entries: Sequence[TensorEntry], metadata: Mapping[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for e in entries:
        if e.dtype not in DTYPE_TO_ST:
            raise CheckpointError(f"safetensors cannot store dtype {e.dtype} (tensor {e.name!r})")
        if e.name in header or e.name == "__metadata__":
            raise CheckpointError(f"duplicate tensor name {e.name!r} in one safetensors file")
        header[e.name] = {
            "dtype": DTYPE_TO_ST[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def file_size(entries: Sequence[TensorEntry], metadata: Mapping[str, str] | None = None) -> int:
    """Exact size in bytes of the file `StreamWriter` would write for these entries."""
    return len(_header_bytes(entries, metadata)) + sum(e.nbytes for e in entries)


def _as_bytes(t: torch.Tensor) -> memoryview:
    # A CPU contiguous tensor seen as raw bytes without a copy (bf16 has no numpy dtype, so
    # view as uint8 first). Cost: one device->host copy for GPU tensors, nothing otherwise.
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")  # the tensor's bytes, no copy


class StreamWriter:
    """Write a safetensors file one tensor at a time, in the order the entries were given.

    `close()` checks every entry was written, flushes and (by default) fsyncs the file. Use it
    as a context manager; on an exception the partial file is removed.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        entries: Sequence[TensorEntry],
        metadata: Mapping[str, str] | None = None,
        *,
        fsync: bool = True,
    ) -> None:
        self.path = os.fspath(path)
        self._entries = list(entries)
        self._next = 0
        self._fsync = fsync
        self._file: BinaryIO | None = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(_header_bytes(self._entries, metadata))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._file is None:
            raise CheckpointError(f"{self.path}: writer already closed")
        if self._next >= len(self._entries):
            raise CheckpointError(f"{self.path}: tensor {name!r} was not declared")
        e = self._entries[self._next]
        if name != e.name:
            raise CheckpointError(f"{self.path}: expected tensor {e.name!r} next, got {name!r}")
        if tensor.dtype != e.dtype or tensor.numel() != e.numel:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} is {tensor.dtype} with {tensor.numel()} elements; "
                f"declared {e.dtype} with shape {list(e.shape)}"
            )
        self._file.write(_as_bytes(tensor))
        self._next += 1

    def close(self) -> None:
        if self._file is None:
            return
        f, self._file = self._file, None
        try:
            if self._next != len(self._entries):
                missing = [e.name for e in self._entries[self._next :]]
                raise CheckpointError(f"{self.path}: closed before writing {missing[:5]}")
            f.flush()
            if self._fsync:
                os.fsync(f.fileno())
        finally:
            f.close()

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


@dataclass(frozen=True)
class _Stored:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


class SafetensorsReader:
    """Header-only open of a safetensors file; `read` fetches any element range of a tensor.

    `close()` releases the file descriptor but keeps the parsed header; a later `read` reopens
    the file (a reader of many files can bound its open descriptors without re-parsing).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._file: io.BufferedReader | None = self._open()
        try:
            raw_len = self._file.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{self.path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw_len)
            size = os.fstat(self._file.fileno()).st_size
            if n > size - 8:
                raise CheckpointError(f"{self.path}: truncated or corrupt safetensors header")
            header = json.loads(self._file.read(n))
        except (ValueError, UnicodeDecodeError) as err:
            self._file.close()
            raise CheckpointError(f"{self.path}: corrupt safetensors header ({err})") from err
        except CheckpointError:
            self._file.close()
            raise
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        data_start = 8 + n
        self._tensors: dict[str, _Stored] = {}
        for name, info in header.items():
            dtype = ST_TO_DTYPE.get(info["dtype"])
            if dtype is None:
                self._file.close()
                raise CheckpointError(f"{self.path}: unsupported dtype {info['dtype']} for {name!r}")
            b, e = info["data_offsets"]
            if data_start + e > size:
                self._file.close()
                raise CheckpointError(f"{self.path}: truncated (tensor {name!r} ends past the end of file)")
            self._tensors[name] = _Stored(dtype, tuple(info["shape"]), data_start + b, data_start + e)

    def _open(self) -> io.BufferedReader:
        try:
            return open(self.path, "rb")  # noqa: SIM115 - closed in close()
        except OSError as err:
            raise CheckpointError(f"cannot open {self.path}: {err.strerror}") from err

    @property
    def is_open(self) -> bool:
        return self._file is not None

    def keys(self) -> list[str]:
        return list(self._tensors)

    def dtype(self, name: str) -> torch.dtype:
        return self._stored(name).dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self._stored(name).shape

    def _stored(self, name: str) -> _Stored:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name!r}") from None

    def read(self, name: str, start: int = 0, end: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor, as a 1-D tensor of the stored dtype.

        With `out` (1-D, contiguous, CPU, `end - start` elements) the bytes land directly in it
        when the dtype matches; otherwise they are read once and cast into it.
        """
        st = self._stored(name)
        numel = 1
        for s in st.shape:
            numel *= s
        end = numel if end is None else end
        if not 0 <= start <= end <= numel:
            raise CheckpointError(f"{self.path}: range [{start}, {end}) outside {name!r} ({numel} elements)")
        n = end - start
        direct = out is not None and out.dtype == st.dtype and out.device.type == "cpu" and out.is_contiguous()
        buf = out.reshape(-1) if direct and out is not None else torch.empty(n, dtype=st.dtype)
        if buf.numel() != n:
            raise CheckpointError(f"{self.path}: destination has {buf.numel()} elements, range has {n}")
        if n:
            if self._file is None:
                self._file = self._open()
            item = buf.element_size()
            self._file.seek(st.begin + start * item)
            view = buf.view(torch.uint8).numpy().data.cast("B")  # writes land in `buf`
            got = self._file.readinto(view)
            if got != n * item:
                raise CheckpointError(f"{self.path}: short read of {name!r} (file truncated?)")
        if out is not None and not direct:
            out.reshape(-1).copy_(buf)
            return out
        return buf if out is None else out

    def read_tensor(self, name: str) -> torch.Tensor:
        """A whole tensor with its stored shape."""
        return self.read(name).reshape(self.shape(name))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
