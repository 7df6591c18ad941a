"""Reaching many nodes at once: bounded parallelism, retries before anything started, one table
of every node that failed and why.

`fan_out(items, connect, parallelism=..., retries=..., backoff_s=...)` runs `connect(item,
attempt)` for every item with at most `parallelism` in flight (pdsh's default fan-out is 32).
`connect` raises `NodeFailure(category, message, transient=...)`; a transient failure (refused,
timed out, sshd throttling new connections with MaxStartups) is retried with exponential
backoff and jitter. Retrying is only safe before the remote command has started (a retried
`exec` could leave a duplicate agent running), so `connect` must cover only the part before it.
Used by `launch/ssh.py` (real connections) and `launch/simulate.py` (simulated ones).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from zerorun.errors import LaunchError

__all__ = ["NodeFailure", "Failed", "fan_out", "failure_table", "DEFAULT_PARALLELISM"]

DEFAULT_PARALLELISM = 32  # pdsh's default fan-out
K = TypeVar("K", bound=Hashable)
R = TypeVar("R")


class NodeFailure(LaunchError):
    """Why one node could not be reached. `category`: a short word for the table (`auth`,
    `unreachable`, `host key`, `version`, `timeout`, ...)."""

    def __init__(self, category: str, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.category = category
        self.message = message
        self.transient = transient


@dataclass(frozen=True)
class Failed(Generic[K]):
    node: K
    category: str
    message: str
    attempts: int


def fan_out(
    items: Iterable[K],
    connect: Callable[[K, int], R],
    *,
    parallelism: int = DEFAULT_PARALLELISM,
    retries: int = 2,
    backoff_s: float = 0.5,
    cancel: threading.Event | None = None,
) -> tuple[dict[K, R], dict[K, Failed[K]]]:
    """Connect to every item, at most `parallelism` at once; a transient failure is retried up
    to `retries` more times (waits backoff_s, 2 x backoff_s, ... each +-50% jitter). Returns
    (results, failures); every item is in exactly one. Other exceptions count as failures of
    category "error" (one bad node must not hide the others)."""
    keys = list(items)
    results: dict[K, R] = {}
    failures: dict[K, Failed[K]] = {}
    lock = threading.Lock()

    def one(key: K) -> None:
        attempt = 0
        while True:
            try:
                value = connect(key, attempt)
            except NodeFailure as err:
                if err.transient and attempt < retries and not (cancel and cancel.is_set()):
                    delay = backoff_s * (2**attempt) * random.uniform(0.5, 1.5)  # noqa: S311 - jitter
                    attempt += 1
                    time.sleep(delay)
                    continue
                with lock:
                    failures[key] = Failed(key, err.category, err.message, attempt + 1)
                return
            except Exception as err:  # noqa: BLE001 - reported in the table
                with lock:
                    failures[key] = Failed(key, "error", f"{type(err).__name__}: {err}", attempt + 1)
                return
            with lock:
                results[key] = value
            return

    if keys:
        with ThreadPoolExecutor(max_workers=max(1, min(parallelism, len(keys)))) as pool:
            for fut in [pool.submit(one, k) for k in keys]:
                fut.result()
    return results, failures


def failure_table(
    failures: Mapping[K, Failed[K]], *, what: str = "Connecting", names: Mapping[K, str] | None = None, limit: int = 50
) -> str:
    """The nodes that failed and why, one aligned row each (the first `limit`), with a count per
    category first: `SSH failed on 12 nodes: 10 unreachable, 2 auth`."""
    rows = sorted(failures.values(), key=lambda f: (f.category, str((names or {}).get(f.node, f.node))))
    counts: dict[str, int] = {}
    for f in rows:
        counts[f.category] = counts.get(f.category, 0) + 1
    plural = "s" if len(rows) != 1 else ""
    head = f"{what} failed on {len(rows)} node{plural}: " + ", ".join(
        f"{n} {c}" for c, n in sorted(counts.items(), key=lambda x: -x[1])
    )
    cells = [(str((names or {}).get(f.node, f.node)), f.category, str(f.attempts), f.message) for f in rows[:limit]]
    w0 = max([4, *(len(c[0]) for c in cells)])
    w1 = max([6, *(len(c[1]) for c in cells)])
    lines = [head, f"  {'node'.ljust(w0)}  {'reason'.ljust(w1)}  tries  detail"]
    lines += [f"  {a.ljust(w0)}  {b.ljust(w1)}  {c.rjust(5)}  {d}" for a, b, c, d in cells]
    if len(rows) > limit:
        lines.append(f"  ... and {len(rows) - limit} more")
    return "\n".join(lines)
