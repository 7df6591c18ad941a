"""Save and load a sharded checkpoint: the collective choreography around the format.

The engine is seen only through `CheckpointView` (a handful of methods listing its fragments
and restoring its small objects); everything about files, crash safety, resharding and RNG is
here. See [Note: checkpoint fragments] in format.py and docs/checkpoints.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from zerorun._version import __version__
from zerorun.errors import CheckpointError

from . import atomic
from .format import (
    BUFFER,
    ENGINE_STATE_FILE,
    META_FILE,
    OPTIM_PREFIX,
    TMP_PREFIX,
    WEIGHT,
    CheckpointMeta,
    Fragment,
    rng_file,
    shard_file,
)
from .rng import capture_rng, reseed_from, restore_rng
from .store import CheckpointReader, write_rank_shard

__all__ = ["CheckpointView", "save_checkpoint", "load_checkpoint", "resolve_tag", "default_tag"]

log = logging.getLogger("zerorun.checkpoint")


class CheckpointView(Protocol):
    """What the checkpoint code needs from an engine (the engine's side of Contract 7)."""

    rank: int
    world_size: int
    process_group: Any  # torch.distributed ProcessGroup or None (WORLD / no process group)

    def checkpoint_meta(self) -> CheckpointMeta:
        """Stage, precision, parameters/buffers in order, tied aliases, optimizer class,
        hyperparameters and scalar state, counters. Identical on every rank."""

    def checkpoint_fragments(self, *, for_load: bool, kinds: set[str] | None = None) -> list[Fragment]:
        """Live views of what this rank holds (saving reads them). With ``for_load``: tensors to
        fill, for the state kinds in `kinds` (those the checkpoint has and the caller wants);
        optimizer states may be fresh tensors the view hands to its optimizer afterwards."""

    def checkpoint_state(self) -> dict[str, Any]:
        """Small picklable objects saved by rank 0: scheduler, loss scaler, ..."""

    def restore_checkpoint_state(
        self, state: dict[str, Any], meta: CheckpointMeta, *, optimizer: bool, scheduler: bool, module_only: bool
    ) -> None:
        """Restore what `checkpoint_state` returned (and counters/hyperparameters from `meta`)."""

    def after_checkpoint_load(self) -> None:
        """Re-derive what was not loaded directly (e.g. 16-bit params from master weights)."""


class _Comm:
    def __init__(self, view: CheckpointView) -> None:
        self.rank = view.rank
        self.world_size = view.world_size
        self.group = view.process_group
        import torch.distributed as dist

        self._dist = dist if (dist.is_available() and dist.is_initialized()) else None
        if self._dist is None and self.world_size > 1:
            raise CheckpointError("a multi-rank checkpoint needs an initialized process group")

    def barrier(self) -> None:
        if self._dist is not None:
            self._dist.barrier(group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self._dist is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def agree(self, error: str | None, failed: str, when: str, untouched: str) -> None:
        """Every rank's outcome of a save phase: raise on all of them if any rank failed (its
        message), or if a rank is gone (the collective raises; ``when`` says at which point)."""
        try:
            errors = [e for e in self.all_gather_object(error) if e is not None]
        except RuntimeError as err:
            raise CheckpointError(f"{failed}: a rank stopped {when} ({err}); {untouched}") from err
        if errors:
            raise CheckpointError(f"{failed}: {'; '.join(errors[:4])}; {untouched}")

    def broadcast_object(self, obj: Any) -> Any:
        if self._dist is None:
            return obj
        box = [obj]
        src = self._dist.get_global_rank(self.group, 0) if self.group is not None else 0
        self._dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]


def default_tag(meta: CheckpointMeta) -> str:
    return f"global_step{meta.counters.get('global_steps', 0)}"


def _check_tag(tag: str) -> None:
    if not tag or "/" in tag or os.sep in tag or tag.startswith(".") or tag == "latest":
        raise CheckpointError(
            f"invalid checkpoint tag {tag!r}: use a plain directory name such as 'global_step100' "
            "(no '/', not starting with '.', not 'latest')"
        )


def save_checkpoint(
    view: CheckpointView,
    save_dir: str | os.PathLike[str],
    tag: str | None = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
    *,
    rng: dict[str, Any] | None = None,
    before_commit: Callable[[Path, int], None] | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the checkpoint's directory.

    `rng`: this rank's RNG states as captured earlier (an asynchronous save's snapshot, written
    from another thread); default: captured now.
    `before_commit(tmp_dir, rank)`: called on every rank once every rank's files are in the
    temporary tag directory (readable there with `CheckpointReader`), before rank 0 renames it
    into place and moves `latest`: files it adds there (compat's DeepSpeed layout) are committed
    with the rest or not at all. Any exception it raises fails the save on every rank like a
    shard's (the tag is not committed, `latest` stays)."""
    comm = _Comm(view)
    meta = view.checkpoint_meta()
    tag = str(tag) if tag is not None else default_tag(meta)
    _check_tag(tag)
    tags = comm.all_gather_object(tag)
    if len(set(tags)) != 1:
        raise CheckpointError(f"ranks passed different checkpoint tags to save_checkpoint: {sorted(set(tags))}")
    root = Path(save_dir)
    tmp = atomic.tmp_dir_for(root, tag)
    final = root / tag

    # Phase 1: rank 0 prepares an empty temporary directory. Failures travel to every rank
    # (a broadcast instead of a barrier), so no rank is left waiting for one that raised.
    status: str | None = None
    if comm.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for stale in atomic.remove_stale_tmp_dirs(root):
                log.warning("zerorun: removed %s, left by a checkpoint save that did not finish", stale)
            tmp.mkdir()
        except OSError as err:
            status = f"checkpoint save: cannot create {tmp}: {err.strerror}"
    status = comm.broadcast_object(status)
    if status is not None:
        raise CheckpointError(status)

    # Phase 2: every rank writes its fragments and RNG state; rank 0 the metadata.
    meta.tag = tag
    meta.world_size = comm.world_size
    meta.zerorun_version = __version__
    fragments = view.checkpoint_fragments(for_load=False)
    # Identical on every rank (same engine); an async snapshot, which holds only the pieces its
    # rank writes, brings the full list.
    meta.kinds = meta.kinds or sorted({f.kind for f in fragments})
    error: str | None = None
    try:
        if not tmp.is_dir():
            raise CheckpointError(
                f"rank {comm.rank} does not see {tmp}, which rank 0 created; save_dir must be a "
                "filesystem shared by all nodes"
            )
        write_rank_shard(
            tmp, comm.rank, comm.world_size, fragments,
            on_half_written=lambda: atomic.maybe_crash(comm.rank, "mid_shard"),
        )
        _save_pt(tmp / rng_file(comm.rank), capture_rng() if rng is None else rng)
        if comm.rank == 0:
            state = dict(view.checkpoint_state())
            state["client_state"] = dict(client_state or {})
            _save_pt(tmp / ENGINE_STATE_FILE, state)
            _write_text(tmp / META_FILE, meta.to_json())
    except (OSError, CheckpointError) as err:  # disk full, permissions, ...
        error = f"rank {comm.rank}: {err}"
    # A rank that died before here makes this collective raise on the others. Either way the
    # temporary directory stays behind (cleaned by the next save) and `latest` is untouched.
    untouched = f"the previous checkpoint and {root / 'latest'} are untouched"
    comm.agree(error, f"checkpoint save to {final} failed", "before its files were written", untouched)
    if before_commit is not None:
        try:
            before_commit(tmp, comm.rank)
        except Exception as err:  # noqa: BLE001 - every rank must reach the gather below, or they hang
            error = f"rank {comm.rank}: {err}" if isinstance(err, (OSError, CheckpointError)) else (
                f"rank {comm.rank}: {type(err).__name__}: {err}"
            )
        comm.agree(error, f"checkpoint save to {final} failed", "while adding its files", untouched)

    # Phase 3: rank 0 commits: rename into place, then `latest`.
    if comm.rank == 0:
        try:
            atomic.maybe_crash(0, "before_commit")
            missing = [shard_file(r) for r in range(comm.world_size) if not (tmp / shard_file(r)).is_file()]
            if missing:
                raise CheckpointError(
                    f"checkpoint save: rank 0 does not see {', '.join(missing[:4])} in {tmp}; save_dir must "
                    "be a filesystem shared by all nodes"
                )
            atomic.commit_dir(tmp, final)
            atomic.maybe_crash(0, "before_latest")
            if save_latest:
                atomic.write_latest(root, tag)
        except (OSError, CheckpointError) as err:
            status = str(err)
    status = comm.broadcast_object(status)
    if status is not None:
        raise CheckpointError(status)
    return final


def resolve_tag(load_dir: Path, tag: str | None) -> str | None:
    """The tag to load: the given one, else `latest`'s; None when there is no checkpoint yet."""
    atomic.restore_replaced_tags(load_dir)  # a re-save of a tag that died mid-replace
    stale = atomic.stale_tmp_dirs(load_dir)
    if stale:
        log.warning(
            "zerorun: ignoring %s: incomplete checkpoint save(s) (the next save removes them)",
            ", ".join(p.name for p in stale),
        )
    if tag is None:
        tag = atomic.read_latest(load_dir)
        if tag is None:
            return None
        if not (load_dir / tag).is_dir():
            raise CheckpointError(
                f"{load_dir / 'latest'} names tag {tag!r} but {load_dir / tag} does not exist; "
                f"pass tag= explicitly (available: {_available_tags(load_dir) or 'none'})"
            )
        return tag
    tag = str(tag)
    if tag.startswith(TMP_PREFIX):
        raise CheckpointError(f"{load_dir / tag} is an incomplete save and cannot be loaded")
    if not (load_dir / tag).is_dir():
        raise CheckpointError(
            f"no checkpoint {tag!r} in {load_dir} (available: {_available_tags(load_dir) or 'none'})"
        )
    return tag


def _available_tags(load_dir: Path) -> str:
    try:
        names = sorted(p.name for p in load_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    except FileNotFoundError:
        return ""
    return ", ".join(names[:10])


def load_checkpoint(
    view: CheckpointView,
    load_dir: str | os.PathLike[str],
    tag: str | None = None,
    *,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    strict: bool = True,
) -> tuple[str | None, dict[str, Any] | None]:
    """Collective. Loads at any world size / stage. Returns ``(path, client_state)``, or
    ``(None, None)`` when `load_dir` has no `latest` and no tag was given (DeepSpeed's answer,
    which scripts use to decide between resuming and starting fresh).

    ``strict=False`` (DeepSpeed's ``load_module_strict``): parameters and buffers the
    checkpoint lacks keep their current values (and optimizer state: zeros if none existed)
    instead of being an error."""
    comm = _Comm(view)
    root = Path(load_dir)
    if tag is None and (root / META_FILE).is_file():
        path = root  # the tag directory itself was given ("ckpt/global_step100")
    else:
        tag = resolve_tag(root, tag)
        if tag is None:
            if comm.rank == 0:
                log.warning("zerorun: no checkpoint to load: %s does not exist", root / "latest")
            return None, None
        path = root / tag
    with_optim = load_optimizer_states and not load_module_only
    with CheckpointReader(path) as reader:
        meta = reader.meta
        current = view.checkpoint_meta()
        _check_compatible(meta, current, path, with_optim, strict=strict)
        wanted = {k for k in reader.kinds() if with_optim or not k.startswith(OPTIM_PREFIX)}
        for f in view.checkpoint_fragments(for_load=True, kinds=wanted):
            if not strict and not reader.has(f.name, WEIGHT if f.kind != BUFFER else BUFFER):
                continue  # reported by _check_compatible
            if f.kind in (WEIGHT, BUFFER):
                reader.read_into(f.name, f.kind, f.start, f.end, f.tensor)
            elif f.kind.startswith(OPTIM_PREFIX) and with_optim:
                if not reader.has(f.name, f.kind):
                    raise CheckpointError(
                        f"{path}: no optimizer state {f.kind[len(OPTIM_PREFIX):]!r} for {f.name!r} (saved with "
                        f"{meta.optimizer.get('class')}); pass load_optimizer_states=False to load weights only"
                    )
                reader.read_into(f.name, f.kind, f.start, f.end, f.tensor)
    state = _load_pt(path / ENGINE_STATE_FILE)
    view.restore_checkpoint_state(
        state, meta, optimizer=with_optim, scheduler=load_lr_scheduler_states and not load_module_only,
        module_only=load_module_only,
    )
    if not load_module_only:
        _restore_rank_rng(path, meta.world_size, comm.rank, comm.world_size)
    view.after_checkpoint_load()
    comm.barrier()
    return str(path), state.get("client_state", {})


def _restore_rank_rng(path: Path, saved_world: int, rank: int, world_size: int) -> None:
    if rank < saved_world:
        restore_rng(_load_pt(path / rng_file(rank)))
        return
    seed = reseed_from(_load_pt(path / rng_file(0)), rank)
    if rank == saved_world:
        log.warning(
            "zerorun: checkpoint saved by %d ranks loaded by %d: ranks >= %d get fresh RNG seeds "
            "(rank %d: %d); see docs/checkpoints.md", saved_world, world_size, saved_world, rank, seed,
        )


def _check_compatible(
    saved: CheckpointMeta, current: CheckpointMeta, path: Path, with_optim: bool, *, strict: bool = True
) -> None:
    saved_p = {p.name: p for p in saved.params}
    cur_p = {p.name: p for p in current.params}
    missing = [n for n in cur_p if n not in saved_p]
    saved_b = {b.name for b in saved.buffers}
    missing_b = [b.name for b in current.buffers if b.name not in saved_b]
    if missing and strict:
        unexpected = [n for n in saved_p if n not in cur_p]
        raise CheckpointError(
            f"{path}: the model has parameters the checkpoint lacks: {missing[:5]}"
            + (f"; the checkpoint has instead: {unexpected[:5]}" if unexpected else "")
            + " (a different model, renamed modules, or saved with exclude_frozen_parameters? "
            "load_module_strict=False loads what is there)"
        )
    if missing_b and strict:
        raise CheckpointError(
            f"{path}: the model has buffers the checkpoint lacks: {missing_b[:5]} (load_module_strict=False "
            "keeps their current values)"
        )
    if missing or missing_b:
        log.warning("zerorun: %s lacks %s; they keep their current values", path, (missing + missing_b)[:5])
    for name, p in cur_p.items():
        if name not in saved_p:
            continue
        if saved_p[name].shape != p.shape:
            raise CheckpointError(
                f"{path}: parameter {name!r} has shape {list(saved_p[name].shape)} in the checkpoint, "
                f"{list(p.shape)} in the model"
            )
    if with_optim:
        a, b = saved.optimizer.get("class"), current.optimizer.get("class")
        if a and b and a != b:
            raise CheckpointError(
                f"{path}: saved with optimizer {a}, the engine uses {b}; pass load_optimizer_states=False "
                "to load the weights and start the optimizer fresh"
            )


def _save_pt(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _load_pt(path: Path) -> Any:
    try:
        # Checkpoints are trusted like any pickle (DeepSpeed loads them the same way): RNG
        # states hold numpy arrays and client_state is arbitrary.
        return torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete") from None


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
