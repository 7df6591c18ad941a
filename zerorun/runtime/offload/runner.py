"""The thread the CPU optimizer step runs on.

One worker thread per placement, with its own intra-op thread count (``torch.set_num_threads``
is per thread, so the training loop's setting is left alone) and, on CUDA, the training device
as its current device. The exact step is submitted and waited for; the delayed step is
submitted and joined at the next step. An exception in the worker re-raises on ``join``.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

__all__ = ["StepRunner"]


class StepRunner:
    def __init__(self, threads: int, device: torch.device) -> None:
        self.threads = max(1, threads)
        self.device = device
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future[None]] = []

    def _init_thread(self) -> None:
        torch.set_num_threads(self.threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def submit(self, fn: Callable[[], None], *, queue: bool = False) -> Future[None]:
        """Run ``fn`` on the worker; ``queue``: after what is already submitted (else that is
        joined first)."""
        if not queue:
            self.join()
        if self._pool is None:
            # Joined at interpreter exit by concurrent.futures, so a delayed step never dies
            # half-written when the script ends.
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="zerorun-offload", initializer=self._init_thread)
        future = self._pool.submit(fn)
        self._futures.append(future)
        return future

    def run(self, fn: Callable[[], None]) -> None:
        self.submit(fn)
        self.join()

    @property
    def busy(self) -> bool:
        return bool(self._futures)

    def join(self) -> None:
        futures, self._futures = self._futures, []
        for future in futures:
            future.result()

    def close(self) -> None:
        try:
            self.join()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
