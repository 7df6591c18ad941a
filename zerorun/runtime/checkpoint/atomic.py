"""Crash safety for a checkpoint as a whole: temporary tag directory, fsync, rename, `latest`.

A save writes everything into ``SAVE_DIR/.tmp-{tag}``; only when every rank's files are
complete and fsynced does rank 0 rename that directory to ``SAVE_DIR/{tag}`` (a directory
rename is atomic on POSIX filesystems) and only then replace ``latest`` (write a temporary
file, fsync, rename, fsync the directory). A process killed at any point leaves either the
old state or the new one: ``latest`` names only complete checkpoints, and a lookup by tag
never sees ``.tmp-*`` directories.

Deterministic crash injection for tests: ``ZERORUN_CHECKPOINT_CRASH=RANK:POINT`` makes that
rank SIGKILL itself at POINT (see `CRASH_POINTS`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import signal
import sys
from pathlib import Path

from zerorun.errors import CheckpointError

from .format import LATEST_FILE, TMP_PREFIX

__all__ = [
    "CRASH_ENV",
    "CRASH_POINTS",
    "maybe_crash",
    "fsync_dir",
    "tmp_dir_for",
    "remove_stale_tmp_dirs",
    "stale_tmp_dirs",
    "commit_dir",
    "write_latest",
    "read_latest",
]

CRASH_ENV = "ZERORUN_CHECKPOINT_CRASH"
# mid_shard: half of the rank's shard file written; before_commit: all files written, rank 0
# has not renamed yet; before_latest: tag directory in place, `latest` not yet updated.
CRASH_POINTS = ("mid_shard", "before_commit", "before_latest")


def maybe_crash(rank: int, point: str) -> None:
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    want_rank, _, want_point = spec.partition(":")
    if want_point not in CRASH_POINTS:
        raise CheckpointError(f"{CRASH_ENV}={spec!r}: point must be one of {', '.join(CRASH_POINTS)}")
    if int(want_rank) == rank and want_point == point:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a directory's entries (created/renamed files) durable."""
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as err:  # some filesystems (e.g. certain FUSE mounts) refuse dir fsync
        if err.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def tmp_dir_for(save_dir: Path, tag: str) -> Path:
    return save_dir / f"{TMP_PREFIX}{tag}"


def stale_tmp_dirs(save_dir: Path) -> list[Path]:
    try:
        return sorted(p for p in save_dir.iterdir() if p.name.startswith(TMP_PREFIX) and p.is_dir())
    except FileNotFoundError:
        return []


def remove_stale_tmp_dirs(save_dir: Path) -> list[Path]:
    """Delete leftovers of interrupted saves (saves are collective and one at a time, so any
    ``.tmp-*`` present when a new save starts belongs to a save that died) -- except a replaced
    tag that a crash left only under its ``.tmp-old-TAG`` name: that one is put back first."""
    restore_replaced_tags(save_dir)
    removed = stale_tmp_dirs(save_dir)
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def restore_replaced_tags(save_dir: Path) -> list[Path]:
    """Undo a re-save of a tag that died between `commit_dir`'s two renames (filesystems without
    an atomic exchange): the tag is missing and its complete previous copy is ``.tmp-old-TAG``.
    Called before a save cleans up and before a load looks a tag up."""
    restored = []
    prefix = f"{TMP_PREFIX}old-"
    for p in stale_tmp_dirs(save_dir):
        if p.name.startswith(prefix):
            final = p.with_name(p.name[len(prefix):])
            if not final.exists():
                try:
                    os.rename(p, final)
                except FileNotFoundError:
                    continue  # another rank sharing this directory put it back first
                restored.append(final)
    if restored:
        fsync_dir(save_dir)
    return restored


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise CheckpointError(f"cannot replace {b} with {a}: {os.strerror(err)}")


def commit_dir(tmp: Path, final: Path) -> None:
    """Move a completed temporary tag directory into place, replacing an older one of the same
    tag atomically where the filesystem allows (otherwise: two renames, a tiny window in which
    the tag is absent but ``latest`` still names the previous complete tag... or this one)."""
    fsync_dir(tmp)
    if final.exists():
        if not _exchange(tmp, final):
            old = final.with_name(f"{TMP_PREFIX}old-{final.name}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)  # now holds the replaced checkpoint
    else:
        os.rename(tmp, final)
    fsync_dir(final.parent)


def write_latest(save_dir: Path, tag: str) -> None:
    tmp = save_dir / f"{TMP_PREFIX}{LATEST_FILE}"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, save_dir / LATEST_FILE)
    fsync_dir(save_dir)


def read_latest(load_dir: Path) -> str | None:
    try:
        return (load_dir / LATEST_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None
