"""Reaching many nodes at once: bounded parallelism, retries before anything started, one table
of every node that failed and why.

`fan_out(items, connect, parallelism=..., retries=..., backoff_s=...)` runs `connect(item,
attempt)` for every item with at most `parallelism` in flight (pdsh's default fan-out is 32).
`connect` raises `NodeFailure(category, message, transient=...)`; a transient failure (refused,
timed out, sshd throttling new connections with MaxStartups) is retried with exponential
backoff and jitter. Retrying is only safe before the remote command has started (a retried
`exec` could leave a duplicate agent running), so `connect` must cover only the part before it.
Used by `launch/ssh.py` (real connections) and `launch/simulate.py` (simulated ones).

`failure_table` is how every problem found before anything starts is reported, node by node:
connecting, the agents' preflight (version, script, port, interpreter, working directory), the
device check, on every transport (SSH, Slurm/MPI dial-in, the simulation): which node, what is
wrong, the fix -- in the console's table format (`launch/text_table.py`, as its summaries).
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from zerorun.errors import LaunchError
from zerorun.launch.text_table import table_text

__all__ = ["NodeFailure", "Failed", "fan_out", "failure_table", "split_fix", "DEFAULT_PARALLELISM"]

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
    failures: Mapping[K, Failed[K]],
    *,
    what: str = "Connecting",
    names: Mapping[K, str] | None = None,
    limit: int = 50,
    unit: str = "node",
) -> str:
    """The nodes that failed and why, one row each (the first `limit`): the node, the problem's
    category, what is wrong and the fix (`split_fix` of the message), and how many tries when
    any node was tried more than once; a count per category first: `SSH failed on 12 nodes: 10
    unreachable, 2 auth` (`unit`: what a row is, "line" for a hostfile's)."""
    rows = sorted(failures.values(), key=lambda f: (f.category, str((names or {}).get(f.node, f.node))))
    counts: dict[str, int] = {}
    for f in rows:
        counts[f.category] = counts.get(f.category, 0) + 1
    plural = "s" if len(rows) != 1 else ""
    head = f"{what} failed on {len(rows)} {unit}{plural}: " + ", ".join(
        f"{n} {c}" for c, n in sorted(counts.items(), key=lambda x: -x[1])
    )
    tries = any(f.attempts > 1 for f in rows)
    cells = []
    for f in rows[:limit]:
        wrong, fix = split_fix(f.message)
        node = str((names or {}).get(f.node, f.node))
        cells.append([node, f.category, *([str(f.attempts)] if tries else []), wrong, fix or "-"])
    columns = [unit, "problem", *(["tries"] if tries else []), "what", "fix"]
    lines = [head, *(f"  {line.rstrip()}" for line in table_text(columns, cells))]
    if len(rows) > limit:
        lines.append(f"  ... and {len(rows) - limit} more")
    return "\n".join(lines)


# The end of a message's first sentence: a period (or two: "failed.." after a quoted error)
# and a space, not after "e.g"/"i.e".
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)\.+\s+(?=\S)")


def split_fix(message: str) -> tuple[str, str]:
    """A problem's message as (what is wrong, the fix): its first sentence and the rest, as
    zerorun's messages are written ("cannot reach n1: no answer within 10 s. Check the name...").
    A message of one sentence has no fix ("")."""
    m = _SENTENCE_END.search(message)
    if m is None:
        return message.rstrip().rstrip("."), ""
    return message[: m.start()], message[m.end() :].strip()
