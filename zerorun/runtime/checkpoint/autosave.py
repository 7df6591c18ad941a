"""What the engine does about checkpoints without the script asking (options.py,
docs/fault-tolerance.md): resume at `zerorun.initialize`, periodic (and asynchronous) saves
from `engine.step()`, and a save-and-exit when the job is preempted.

`zerorun.initialize` builds one `EngineCheckpointing` when the config or the launcher asks for
any of it, calls `resume()` before returning the engine, and the engine calls `after_step()` at
every accumulation boundary (after the optimizer step and its counters). Nothing here runs
otherwise.

Preemption (``zerorun --save_on_preemption``): SIGTERM -- to the launcher, which forwards it, or
to the ranks themselves as Slurm and Kubernetes do -- only sets a flag. Ranks may get it at
different steps, so at every boundary each rank all-reduces (MAX) its flag, asynchronously, and
reads the previous boundary's result: all ranks see the same value at the same boundary, save
the same step together (no rank waits in a save the others never reach) and exit with
`PREEMPTED_EXIT_CODE`. Cost: one 4-byte all-reduce per optimizer step, read one step later
(no host sync on the step's own work).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zerorun.channel import events

from . import atomic
from .async_save import AsyncSaver, side_group
from .engine_view import EngineCheckpointView
from .format import META_FILE
from .options import PREEMPTED_EXIT_CODE, CheckpointOptions
from .sharded import save_checkpoint

if TYPE_CHECKING:
    from zerorun.runtime.engine import Engine

__all__ = ["EngineCheckpointing", "prune_checkpoints"]

log = logging.getLogger("zerorun.checkpoint")

_STEP_TAG = re.compile(r"^global_step(\d+)$")


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"zerorun: {text}", file=sys.stderr, flush=True)


def prune_checkpoints(save_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` `global_stepN` directories (never the one `latest`
    names). Rank 0, after a commit."""
    latest = atomic.read_latest(save_dir)
    try:
        tags = [(int(m.group(1)), p) for p in save_dir.iterdir() if p.is_dir() and (m := _STEP_TAG.match(p.name))]
    except FileNotFoundError:
        return []
    tags.sort()
    removed = []
    for _, path in tags[: max(0, len(tags) - keep_last)]:
        if path.name == latest:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class _PreemptionWatch:
    """SIGTERM sets a flag; `agreed()` says, identically on every rank, whether to stop now."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.signalled = False
        self._pending: tuple[Any, torch.Tensor, Any, torch.Tensor | None] | None = None
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def close(self) -> None:
        """SIGTERM means what it meant before (engine.destroy(): no step boundary comes any more)."""
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_signal(self, signum: int, _frame: object) -> None:
        if not self.signalled:
            self.signalled = True
            rank = self.engine.comm.rank
            # os.write, not print: the handler may interrupt a print holding the stream's lock.
            text = f"zerorun: rank {rank} got SIGTERM: saving a checkpoint at the next step boundary, then exiting\n"
            os.write(2, text.encode())

    def agreed(self) -> bool:
        import torch.distributed as dist

        comm = self.engine.comm
        if comm.world_size == 1 or not dist.is_initialized():
            return self.signalled
        stop = False
        if self._pending is not None:
            work, flag, event, host = self._pending
            work.wait()
            if event is not None:
                event.synchronize()  # recorded a step ago: long complete
                stop = bool(host.item()) if host is not None else False
            else:
                stop = bool(flag.item())
        device = self.engine.device
        # torch.full is a fill kernel; torch.tensor([...], device="cuda") would copy from pageable
        # host memory and synchronize the stream -- a host sync at every step boundary.
        flag = torch.full((1,), 1 if self.signalled else 0, dtype=torch.int32, device=device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=comm.group, async_op=True)
        event = host = None
        if device.type == "cuda":
            work.wait()  # stream-ordered: the copy below runs after the reduction
            host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._pending = (work, flag, event, host)
        return stop


class EngineCheckpointing:
    """The engine's own checkpoints (module docstring). `engine.checkpointing` holds it."""

    def __init__(self, engine: Engine, options: CheckpointOptions, *, pg_timeout_s: float | None = None) -> None:
        self.engine = engine
        self.options = options
        self.saver: AsyncSaver | None = None
        if options.async_save:
            self.saver = AsyncSaver(side_group(pg_timeout_s), engine.device)
        self.preemption = _PreemptionWatch(engine) if options.save_on_preemption else None
        self.last_save: dict[str, Any] | None = None
        # Files added to every save before its commit (sharded.save_checkpoint): the compat
        # layer's DeepSpeed layout under --deepspeed-compat.
        self.before_commit: Callable[[Path, int], None] | None = None

    # -- resume -------------------------------------------------------------------------------
    def resume(self) -> str | None:
        """Load `latest` of the load directory when there is one (collective)."""
        e = self.engine
        load_dir = self.options.load_dir
        if load_dir is None:
            return None
        # `latest` of a checkpoint directory, or a tag directory itself (--resume_from ckpt/global_step100)
        if not ((Path(load_dir) / "latest").is_file() or (Path(load_dir) / META_FILE).is_file()):
            _say(e.comm.rank, f"no checkpoint in {load_dir} yet: starting from the beginning")
            return None
        path, client_state = e.load_checkpoint(load_dir)
        if path is None:
            return None
        e.resumed_from = path
        e.resumed_client_state = client_state or {}
        loader = getattr(e, "training_dataloader", None)
        skipped = getattr(loader, "resume_skip", 0)
        where = f"; the data loader skips the {skipped} batch(es) of its pass already trained on" if skipped else ""
        _say(e.comm.rank, f"resumed from {path} at step {e.global_steps}{where}")
        if events.connected():
            events.emit("resumed", path=str(path), step=int(e.global_steps))
        return path

    # -- saves --------------------------------------------------------------------------------
    def after_step(self) -> None:
        """At an accumulation boundary, after the optimizer step and the counters."""
        e = self.engine
        if self.preemption is not None and self.preemption.agreed():
            self._save_and_exit()
        n = self.options.every_n_steps
        if n > 0 and e.global_steps % n == 0:
            self.save(asynchronous=self.saver is not None)

    def save(self, *, asynchronous: bool) -> str:
        e = self.engine
        save_dir = Path(self.options.save_dir or ".")
        tag = f"global_step{e.global_steps}"
        e.stage.state.synchronize()  # a delayed offload step still running
        e.stage.wait_params()  # the step's parameter all-gather (stages 1-2 leave it in flight)
        view = EngineCheckpointView(e)
        keep = self.options.keep_last
        rank = e.comm.rank

        def prune() -> None:
            if keep > 0 and rank == 0:
                for p in prune_checkpoints(save_dir, keep):
                    log.info("zerorun: removed old checkpoint %s (keep_last %d)", p, keep)

        if asynchronous and self.saver is not None:
            self.saver.save(view, save_dir, tag, on_commit=prune, before_commit=self.before_commit)
            self.last_save = {"tag": tag, "async": True, "stall_s": self.saver.last_stall_s}
        else:
            self.wait()
            save_checkpoint(view, save_dir, tag, before_commit=self.before_commit)
            prune()
            self.last_save = {"tag": tag, "async": False}
        if events.connected():
            events.emit("checkpoint", dir=str(save_dir), **self.last_save)
        return tag

    def wait(self) -> None:
        """The asynchronous save in flight, if any, is committed (or its error raised)."""
        if self.saver is not None:
            self.saver.wait()

    def _save_and_exit(self) -> None:
        e = self.engine
        tag = self.save(asynchronous=False)
        where = f"{self.options.save_dir}/{tag}"
        _say(e.comm.rank, f"preempted; checkpoint {tag} saved ({where}); exiting with code {PREEMPTED_EXIT_CODE}")
        if events.connected():
            events.emit("preempted", tag=tag, dir=str(self.options.save_dir), step=int(e.global_steps))
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def close(self) -> None:
        if self.preemption is not None:
            self.preemption.close()
        self.wait()
