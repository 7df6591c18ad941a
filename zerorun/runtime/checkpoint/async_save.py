"""Asynchronous checkpoint saves: the step stalls only for a copy into host memory.

A save is cut in two:

1. `AsyncSaver.save` (the training thread, at a step boundary): waits for the previous save if
   one is still in flight (at most one snapshot lives in host memory), then takes a *snapshot*:
   the pieces of state this rank writes (`format.owned_pieces` -- exactly what a synchronous
   save writes) copied into host buffers (pinned when the device is CUDA; allocated once and
   reused while the layout stays the same), its RNG states, and, on rank 0, the metadata and the
   small objects (scheduler, loss scaler: deep copies). Nothing else is done on this thread.
2. A background thread runs the ordinary collective save (`sharded.save_checkpoint`) over that
   snapshot: temporary directory, each rank's files written and fsynced, the ranks' outcomes
   exchanged, rank 0's rename and `latest`. Its collectives go over a process group of its own
   (`side_group`, gloo, created once at initialize), never the training group, whose
   collectives the training thread keeps issuing meanwhile. `latest` is therefore replaced
   only once every rank's part is durable, and a crash during the write leaves the previous
   `latest`; the files are byte for byte those of a synchronous save of the same step.

A failure in the background (disk full, a rank that died) is raised on the training thread
by the next `save` or `wait`.

`torch.distributed.destroy_process_group()` destroys the writer's group too, so a script that
calls it right after its last step would lose a save still in flight: while an `AsyncSaver`
exists, that function first waits for the savers' writes (`_wait_before_destroy`).
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from .format import CheckpointMeta, Fragment, owned_pieces
from .rng import capture_rng
from .sharded import save_checkpoint

__all__ = ["AsyncSaver", "SnapshotView", "side_group"]

log = logging.getLogger("zerorun.checkpoint")


def side_group(timeout_s: float | None = None) -> Any:
    """A gloo group of every rank for the background writer (also at world size 1: the writer
    must never issue collectives on the training thread's group); None without a process
    group. Collective: every rank calls it, at the same point (initialize)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    kwargs: dict[str, Any] = {"backend": "gloo"}
    if timeout_s:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    return dist.new_group(**kwargs)


class SnapshotView:
    """A `CheckpointView` (sharded.py) over a snapshot: what a rank writes, already on the host."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        group: Any,
        meta: CheckpointMeta,
        fragments: list[Fragment],
        state: dict[str, Any] | None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.process_group = group
        self._meta = meta
        self._fragments = fragments
        self._state = state or {}

    def checkpoint_meta(self) -> CheckpointMeta:
        return self._meta

    def checkpoint_fragments(self, *, for_load: bool, kinds: set[str] | None = None) -> list[Fragment]:
        assert not for_load, "a snapshot is only saved"
        return self._fragments

    def checkpoint_state(self) -> dict[str, Any]:
        return self._state

    def restore_checkpoint_state(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover
        raise AssertionError("a snapshot is only saved")

    def after_checkpoint_load(self) -> None:  # pragma: no cover
        raise AssertionError("a snapshot is only saved")


_SAVERS: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()


def _wait_before_destroy() -> None:
    """Make `torch.distributed.destroy_process_group` wait for asynchronous saves in flight
    (once per process). Scripts call it as `dist.destroy_process_group()`, which looks the
    attribute up at call time."""
    import torch.distributed as dist

    original = dist.destroy_process_group
    if getattr(original, "_zerorun_waits_for_saves", False):
        return

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        for saver in list(_SAVERS):
            try:
                saver.wait()
            except Exception:  # noqa: BLE001 - already logged by the writer; tearing down goes on
                pass
        return original(*args, **kwargs)

    destroy_process_group._zerorun_waits_for_saves = True  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group


class AsyncSaver:
    """One rank's asynchronous saves. `save` from the training thread; `wait` before anything
    else touches the checkpoint directory (a synchronous save, a load, the end of training)."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.device = device
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: list[torch.Tensor] = []
        self.last_stall_s = 0.0  # the training thread's time in the last `save`'s snapshot
        # ... and before it, waiting for the previous save still writing (at most one snapshot
        # lives in host memory): saves closer together than one write block here for the rest.
        self.last_wait_s = 0.0
        self.last_write_s = 0.0  # the background write (and commit) of the last save
        self.last_snapshot_bytes = 0
        self.saves = 0
        _SAVERS.add(self)
        _wait_before_destroy()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its error, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def save(
        self,
        view: Any,
        save_dir: str | Path,
        tag: str,
        *,
        client_state: dict[str, Any] | None = None,
        on_commit: Callable[[], None] | None = None,
        before_commit: Callable[[Path, int], None] | None = None,
    ) -> None:
        """Snapshot `view` (an `EngineCheckpointView`) and start writing it in the background
        (`before_commit`: sharded.save_checkpoint's, run in the writer thread)."""
        t_wait = time.perf_counter()
        self.wait()
        t0 = time.perf_counter()
        self.last_wait_s = t0 - t_wait
        rank, world = view.rank, view.world_size
        meta = view.checkpoint_meta()
        fragments = view.checkpoint_fragments(for_load=False)
        meta.kinds = sorted({f.kind for f in fragments})  # every kind, not only the pieces this rank owns
        host = self._copy_to_host(owned_pieces(fragments, rank, world))
        state = copy.deepcopy(view.checkpoint_state()) if rank == 0 else None
        rng = capture_rng()
        self.last_stall_s = time.perf_counter() - t0
        self.last_snapshot_bytes = sum(f.tensor.numel() * f.tensor.element_size() for f in host)
        snap = SnapshotView(rank, world, self.group, meta, host, state)
        client = copy.deepcopy(dict(client_state or {}))
        self._thread = threading.Thread(
            target=self._write,
            args=(snap, Path(save_dir), tag, client, rng, on_commit, before_commit),
            name="zerorun-checkpoint-writer",
            # Not a daemon: an interpreter that exits waits for the commit (all ranks do, so the
            # writer's collectives complete) instead of leaving a half-written save behind.
            daemon=False,
        )
        self._thread.start()
        self.saves += 1

    def _copy_to_host(self, pieces: list[tuple[Fragment, int, int]]) -> list[Fragment]:
        """The pieces a synchronous save would write, copied into reusable host buffers."""
        specs = [(e - s, f.tensor.dtype) for f, s, e in pieces]
        if [(b.numel(), b.dtype) for b in self._buffers] != specs:
            pin = self.device.type == "cuda" and torch.cuda.is_available()
            self._buffers = [torch.empty(n, dtype=dt, pin_memory=pin) for n, dt in specs]
        out: list[Fragment] = []
        cuda = False
        for (f, s, e), buf in zip(pieces, self._buffers, strict=True):
            src = f.tensor.reshape(-1)[s - f.start : e - f.start]
            cuda = cuda or src.device.type == "cuda"
            buf.copy_(src.detach(), non_blocking=src.device.type == "cuda")
            out.append(Fragment(f.name, f.kind, s, e, buf, replicated=False))
        if cuda:
            # Host sync: the copies must be complete before the training thread changes the
            # state again (the next step) -- this is the stall an async save costs.
            torch.cuda.current_stream(self.device).synchronize()
        return out

    def _write(
        self,
        snap: SnapshotView,
        save_dir: Path,
        tag: str,
        client_state: dict[str, Any],
        rng: dict[str, Any],
        on_commit: Callable[[], None] | None,
        before_commit: Callable[[Path, int], None] | None = None,
    ) -> None:
        t0 = time.perf_counter()
        try:
            save_checkpoint(snap, save_dir, tag, client_state, save_latest=True, rng=rng, before_commit=before_commit)
            if on_commit is not None:
                on_commit()
        except BaseException as err:  # noqa: BLE001 - handed to the training thread
            self._error = err
            log.error("zerorun: asynchronous checkpoint save of %s failed: %s", tag, err)
        finally:
            self.last_write_s = time.perf_counter() - t0
