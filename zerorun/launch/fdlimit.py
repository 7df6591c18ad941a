"""File descriptors: a 1,000-node job needs more than the usual soft limit of 1,024.

The launcher holds one socket per SSH connection (paramiko; a ProxyCommand adds two pipes),
one per simulated or dialled-in agent link, one log file per rank under `--log_dir` (8,000 for
1,000 nodes x 8), and four per local rank (stdout, stderr and event pipes, a pidfd).
`check(needed, what)` runs before each of those is opened (connections, log files): when they
would not fit it lifts the soft RLIMIT_NOFILE to the hard limit (`raise_soft_limit()`, what
systemd recommends for programs that need many descriptors: the soft limit stays low only for
programs that use select()), and if they still do not, fails early with the numbers and the
fix, instead of an EMFILE from deep inside a connection.
"""

from __future__ import annotations

import os

from zerorun.errors import LaunchError

__all__ = ["raise_soft_limit", "open_fds", "check", "limits"]

# Descriptors the launcher needs besides the counted ones (Python, rich, pipes, the selector).
_MARGIN = 64


def limits() -> tuple[int, int]:
    """(soft, hard) RLIMIT_NOFILE; -1 for unlimited."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _norm(soft), _norm(hard)


def _norm(value: int) -> int:
    import resource

    return -1 if value == resource.RLIM_INFINITY else int(value)


def raise_soft_limit() -> tuple[int, int]:
    """Soft limit := hard limit (no-op when already equal or not allowed). Returns the new
    (soft, hard)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass  # e.g. a hard limit above fs.nr_open: keep what we have, check() will tell
    return limits()


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: assume a small number
        return 16


def check(needed: int, what: str) -> None:
    """Make room for `needed` more descriptors (for `what`): raise the soft limit to the hard
    one if they do not fit, and a LaunchError if they still do not."""
    soft, hard = limits()
    if soft < 0:
        return
    if needed + _MARGIN > soft - open_fds():
        soft, hard = raise_soft_limit()
    free = soft - open_fds()
    if soft < 0 or needed + _MARGIN <= free:
        return
    raise LaunchError(
        f"{what} need about {needed + _MARGIN} more file descriptors, but the limit of open files "
        f"(RLIMIT_NOFILE) is {soft} (hard limit {'unlimited' if hard < 0 else hard}) and {soft - free} are "
        f"already open. Raise the hard limit, e.g. `ulimit -Hn {max(needed * 2, 65536)}` as root or "
        "`nofile` in /etc/security/limits.conf (LimitNOFILE= for a systemd service), then start again."
    )
