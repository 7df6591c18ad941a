"""``deepspeed.ops.aio``: ``AsyncIOBuilder`` and the ``aio_handle`` it loads.

DeepSpeed builds a libaio extension for NVMe offload; zerorun's NVMe offload
(``offload_optimizer``/``offload_param`` with ``device: nvme``, runtime/offload/nvme.py) needs
no build, so the op is always compatible (``deepspeed.ops.__compatible_ops__["async_io"]``:
transformers' and accelerate's NVMe tests check it). ``AsyncIOBuilder().load()`` gives a module
with DeepSpeed's ``aio_handle``: whole-file reads/writes of a tensor's bytes with
``pread``/``pwrite`` (sync, or async on the handle's threads and ``wait()``), for code that
swaps tensors to files itself.
"""

from __future__ import annotations

import ctypes
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType

import torch

from zerorun.compat.deepspeed._surface import module_getattr

__all__ = ["AsyncIOBuilder", "aio_handle"]

__getattr__ = module_getattr(__name__)


def _bytes_of(buffer: torch.Tensor) -> memoryview:
    if not buffer.is_contiguous() or buffer.device.type != "cpu":
        raise ValueError("aio_handle reads and writes contiguous CPU tensors")
    raw = ctypes.c_char * (buffer.numel() * buffer.element_size())
    return memoryview(raw.from_address(buffer.data_ptr())).cast("B")


def _transfer(write: bool, buffer: torch.Tensor, filename: str, offset: int) -> int:
    view = _bytes_of(buffer)
    flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
    fd = os.open(filename, flags, 0o644)
    try:
        done = 0
        while done < len(view):
            if write:
                n = os.pwrite(fd, view[done:], offset + done)
            else:
                n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"short {'write' if write else 'read'} of {filename}: {done} of {len(view)} bytes")
            done += n
    finally:
        os.close(fd)
    return done


class aio_handle:  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's ``aio_handle(block_size, queue_depth, single_submit, overlap_events,
    intra_op_parallelism)``: the arguments are kept for its getters; ``intra_op_parallelism``
    threads run the async operations."""

    def __init__(
        self,
        block_size: int = 1 << 20,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
    ) -> None:
        self._params = (block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)
        self._pool = ThreadPoolExecutor(max_workers=max(1, intra_op_parallelism))
        self._pending: list[Future[int]] = []

    def get_block_size(self) -> int:
        return self._params[0]

    def get_queue_depth(self) -> int:
        return self._params[1]

    def get_single_submit(self) -> bool:
        return self._params[2]

    def get_overlap_events(self) -> bool:
        return self._params[3]

    def get_intra_op_parallelism(self) -> int:
        return self._params[4]

    def sync_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return _transfer(False, buffer, filename, file_offset)

    def sync_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return _transfer(True, buffer, filename, file_offset)

    def async_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        self._pending.append(self._pool.submit(_transfer, False, buffer, filename, file_offset))
        return 0

    def async_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        self._pending.append(self._pool.submit(_transfer, True, buffer, filename, file_offset))
        return 0

    def pread(self, buffer: torch.Tensor, filename: str, validate: bool, async_op: bool, file_offset: int = 0) -> int:
        del validate
        return (self.async_pread if async_op else self.sync_pread)(buffer, filename, file_offset)

    def pwrite(self, buffer: torch.Tensor, filename: str, validate: bool, async_op: bool, file_offset: int = 0) -> int:
        del validate
        return (self.async_pwrite if async_op else self.sync_pwrite)(buffer, filename, file_offset)

    def wait(self) -> int:
        """Wait for the async operations; returns how many completed (errors are raised)."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()
        return len(pending)

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        pin = torch.cuda.is_available()
        return torch.empty(num_elem, dtype=example_tensor.dtype, pin_memory=pin)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> None:
        del tensor


class AsyncIOBuilder:
    """DeepSpeed's op builder for ``async_io``: always compatible, nothing to build."""

    NAME = "async_io"
    BUILD_VAR = "DS_BUILD_AIO"

    def absolute_name(self) -> str:
        return "deepspeed.ops.aio.async_io_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def load(self, verbose: bool = True) -> ModuleType:
        return sys.modules[__name__]

    def __repr__(self) -> str:
        return "AsyncIOBuilder(zerorun)"


