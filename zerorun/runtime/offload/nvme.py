"""``offload_optimizer: {device: nvme, nvme_path: DIR}``: fp32 masters and Adam states in files.

Every master shard and each of its elementwise optimizer states is one file under a private
directory ``DIR/zerorun-r{rank}-XXXX`` (removed when the engine is destroyed or the process
exits). The step goes through them in tiles of ``sub_group_size`` elements (rounded up to 1024,
the 4 KiB direct-I/O granule): ``buffer_count`` buffer sets (master + states of one tile each)
rotate so that the reads of the next ``buffer_count - 1`` tiles and the write of the previous one
run on I/O threads while the current tile is stepped. Host memory for that: ``buffer_count x
tile x 12`` bytes (Adam), plus the pipeline's gradient and staging buffers (host_placement.py).

I/O is direct (``O_DIRECT``: no page cache, the disk's own speed) where the filesystem allows
it; where it does not (tmpfs, some container filesystems) it falls back to buffered I/O and says
so once.

The same files are also mapped into memory (``torch.from_file(shared=True)``) and those tensors
*are* ``state.masters`` and the optimizer's state tensors: checkpoints and anything else that
reads or writes them in place work unchanged, and pages come in only when touched. The kernel
keeps the two views coherent (direct reads flush dirty mapped pages first, direct writes
invalidate cached ones); the step never runs while something else touches the mapping. A
checkpoint load replaces the optimizer's state tensors; the next step copies them back into the
files (``_prepare_storage``).
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from zerorun.errors import RuntimeConfigError
from zerorun.runtime.offload.host_placement import HostPlacement, StepJob, TileView
from zerorun.runtime.offload.options import OffloadOptions

__all__ = ["NvmePlacement", "TileFiles"]

ALIGN_BYTES = 4096
ALIGN = ALIGN_BYTES // 4  # fp32 elements per direct-I/O granule
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

_buffered_warned = False
_warn_lock = threading.Lock()


def _warn_buffered(path: str, why: str) -> None:
    global _buffered_warned
    with _warn_lock:
        if _buffered_warned:
            return
        _buffered_warned = True
    warnings.warn(
        f"offload nvme_path {path}: direct I/O is not supported here ({why}); using buffered I/O, so the "
        "page cache holds optimizer state and speed depends on free memory. Use a directory on a local "
        "NVMe filesystem (ext4, xfs) for direct I/O.",
        stacklevel=2,
    )


def _align_up(n: int, to: int) -> int:
    return -(-n // to) * to


class TileFiles:
    """The files of one rank: create, map, read and write fp32 ranges, direct where possible."""

    def __init__(self, nvme_path: str, rank: int) -> None:
        root = Path(nvme_path)
        try:
            root.mkdir(parents=True, exist_ok=True)
            self.dir = Path(tempfile.mkdtemp(prefix=f"zerorun-r{rank}-", dir=root))
        except OSError as exc:
            raise RuntimeConfigError(
                f"zero_optimization.offload_optimizer.nvme_path {nvme_path!r}: cannot create files there "
                f"({exc.strerror or exc}); give a writable directory on a local disk"
            ) from None
        self.nvme_path = nvme_path
        self.direct = hasattr(os, "O_DIRECT")
        self._fds: dict[str, int] = {}
        self._maps: dict[str, torch.Tensor] = {}
        self.nbytes = 0
        self._closed = False
        atexit.register(self.close)

    def create(self, name: str, numel: int, init: torch.Tensor | None = None) -> torch.Tensor:
        """A file of ``numel`` fp32 values (zeros, or ``init``) and its mapping, ``numel`` long."""
        path = self.dir / name
        padded = _align_up(max(numel, 1), ALIGN)
        with open(path, "wb") as f:
            f.truncate(padded * 4)  # sparse zeros
            if init is not None:
                data = init.detach().to(torch.float32).contiguous()
                f.write(memoryview((ctypes.c_char * (data.numel() * 4)).from_address(data.data_ptr())))
        self.nbytes += padded * 4
        mapped = torch.from_file(str(path), shared=True, size=padded, dtype=torch.float32)
        self._maps[name] = mapped
        self._fds[name] = self._open(path)
        return mapped[:numel]

    def create_typed(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled file of ``numel`` values of ``dtype``, mapped (used through the page
        cache only: stage-3 parameter shards)."""
        path = self.dir / name
        size = _align_up(max(numel, 1) * torch.empty((), dtype=dtype).element_size(), ALIGN_BYTES)
        with open(path, "wb") as f:
            f.truncate(size)
        self.nbytes += size
        esize = torch.empty((), dtype=dtype).element_size()
        mapped = torch.from_file(str(path), shared=True, size=size // esize, dtype=dtype)
        self._maps[name] = mapped
        return mapped[:numel]

    def _open(self, path: Path) -> int:
        if self.direct:
            try:
                return os.open(path, os.O_RDWR | os.O_DIRECT)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                self._to_buffered(f"open: {exc.strerror}")
        return os.open(path, os.O_RDWR)

    def _to_buffered(self, why: str) -> None:
        if not self.direct:
            return
        self.direct = False
        _warn_buffered(self.nvme_path, why)
        for name, fd in list(self._fds.items()):
            os.close(fd)
            self._fds[name] = os.open(self.dir / name, os.O_RDWR)

    def read(self, name: str, start: int, buf: torch.Tensor) -> None:
        """Fill ``buf`` (aligned, a multiple of ALIGN long) from element ``start`` (aligned)."""
        self._io(os.preadv, name, start, buf)

    def write(self, name: str, start: int, buf: torch.Tensor) -> None:
        self._io(os.pwritev, name, start, buf)

    def _io(self, op: Callable[..., int], name: str, start: int, buf: torch.Tensor) -> None:
        # The tensor's bytes as a writable buffer for preadv/pwritev (no numpy needed; ``buf``
        # stays alive for the call).
        view = memoryview((ctypes.c_char * (buf.numel() * buf.element_size())).from_address(buf.data_ptr())).cast("B")
        offset = start * 4
        try:
            done = op(self._fds[name], [view], offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self.direct:
                raise
            self._to_buffered(f"{op.__name__}: {exc.strerror}")
            done = op(self._fds[name], [view], offset)
        while done < len(view):  # short transfers are legal; finish them
            more = op(self._fds[name], [view[done:]], offset + done)
            if more <= 0:
                raise OSError(errno.EIO, f"short {op.__name__} on {self.dir / name}")
            done += more

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        self._maps.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def aligned_empty(numel: int) -> torch.Tensor:
    """fp32 buffer whose data pointer is 4 KiB aligned (direct I/O needs it)."""
    raw = torch.empty(numel + ALIGN, dtype=torch.float32)
    skip = (-raw.data_ptr() % ALIGN_BYTES) // 4
    return raw[skip : skip + numel]


class NvmePlacement(HostPlacement):
    name = "nvme"

    def __init__(self, opts: OffloadOptions, device: torch.device) -> None:
        super().__init__(opts, device)
        assert opts.nvme_path is not None
        rank = int(os.environ.get("RANK", "0") or 0)
        self.files = TileFiles(opts.nvme_path, rank)
        self.buffer_count = max(2, opts.buffer_count)
        self._io = ThreadPoolExecutor(2, thread_name_prefix="zerorun-nvme")
        self._sets: list[dict[str, torch.Tensor]] = []
        self._state_maps: list[dict[str, torch.Tensor]] = []

    # -- storage --------------------------------------------------------------------------------
    def _tile_size(self) -> int:
        return _align_up(min(self.opts.sub_group_size, 1 << 30), ALIGN)

    def _new_master(self, index: int, numel: int, fp32_init: Callable[[], torch.Tensor]) -> torch.Tensor:
        self._state_maps.append({})
        return self.files.create(f"{index}.master", numel, init=fp32_init().cpu())

    def _state_tensor(self, index: int, key: str) -> torch.Tensor:
        t = self.files.create(f"{index}.{key}", self.masters[index].numel())
        self._state_maps[index][key] = t
        return t

    def _prepare_storage(self, job: StepJob) -> None:
        # A checkpoint load (torch's load_state_dict) hands the optimizer new state tensors:
        # copy them into the files and put the mapped ones back.
        for i, state in enumerate(job.states):
            if state is None:
                continue
            for key in STATE_KEYS:
                if key not in state:
                    continue
                mapped = self._state_maps[i].get(key)
                if mapped is None:
                    mapped = self._state_tensor(i, key)
                if state[key] is not mapped:
                    with torch.no_grad():
                        mapped.copy_(state[key])
                    state[key] = mapped

    def _buffers(self, keys: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
        tile = self._tile_size()
        if not self._sets or set(self._sets[0]) != set(keys):
            longest = max((b - a for parts in self.tiles for a, b in parts), default=0)
            n = _align_up(min(tile, max(longest, 1)), ALIGN)
            self._sets = [{k: aligned_empty(n) for k in keys} for _ in range(self.buffer_count)]
        return self._sets

    def _tile_views(self, job: StepJob, indices: list[int]) -> Iterator[TileView]:
        amsgrad = any(h is not None and h.amsgrad for h in job.hypers)
        keys = ("master", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
        sets = self._buffers(keys)
        order = [
            (i, k, a, b)
            for i in indices
            if job.states[i] is not None
            for k, (a, b) in enumerate(self.tiles[i])
        ]
        count = len(sets)
        reads: dict[int, Future[None]] = {}
        writes: list[Future[None] | None] = [None] * count

        def issue(idx: int) -> None:
            slot = idx % count
            before = writes[slot]  # that buffer set's previous tile must be on disk first
            reads[idx] = self._io.submit(self._read, order[idx], sets[slot], keys, before)

        try:
            for idx in range(min(count - 1, len(order))):
                issue(idx)
            for idx, (i, k, a, b) in enumerate(order):
                if idx + count - 1 < len(order):
                    issue(idx + count - 1)
                reads.pop(idx).result()
                bufs = sets[idx % count]
                n = b - a
                yield TileView(
                    i,
                    k,
                    a,
                    b,
                    bufs["master"][:n],
                    bufs["exp_avg"][:n],
                    bufs["exp_avg_sq"][:n],
                    bufs["max_exp_avg_sq"][:n] if amsgrad else None,
                )
                writes[idx % count] = self._io.submit(self._write, order[idx], bufs, keys)
        finally:
            for fut in list(reads.values()) + [w for w in writes if w is not None]:
                fut.result()

    def _read(
        self,
        tile: tuple[int, int, int, int],
        bufs: dict[str, torch.Tensor],
        keys: tuple[str, ...],
        before: Future[None] | None,
    ) -> None:
        if before is not None:
            before.result()
        i, _k, a, b = tile
        n = _align_up(b - a, ALIGN)
        for key in keys:
            self.files.read(f"{i}.{key}", a, bufs[key][:n])

    def _write(self, tile: tuple[int, int, int, int], bufs: dict[str, torch.Tensor], keys: tuple[str, ...]) -> None:
        i, _k, a, b = tile
        n = _align_up(b - a, ALIGN)
        for key in keys:
            self.files.write(f"{i}.{key}", a, bufs[key][:n])

    # -- hooks ----------------------------------------------------------------------------------
    def close(self) -> None:
        try:
            super().close()
        finally:
            self._io.shutdown(wait=True)
            self.files.close()

    def add_memory(self, ledger: Any) -> None:
        super().add_memory(ledger)
        ledger.add("buffers", [t for s in self._sets for t in s.values()])
        # The mapped tensors are files, not memory: count them on "nvme", not "cpu".
        ledger.exclude(self.masters)
        ledger.exclude(t for m in self._state_maps for t in m.values())
        ledger.add_bytes("master", "nvme", sum(m.numel() * 4 for m in self.masters))
        ledger.add_bytes(
            "optimizer_states", "nvme", sum(t.numel() * 4 for m in self._state_maps for t in m.values())
        )
