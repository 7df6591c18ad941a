"""What a node runner tells the supervisor, and the runner interface itself (Contract 5).

Runners (`launch/local.py`, `launch/remote.py`, the node agent) post these frozen messages
from their own threads; the supervisor consumes them on the main thread. Kept apart from the
supervisor so that runners depend on the vocabulary, not on the loop that consumes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from zerorun.launch.plan import NodePlan

__all__ = [
    "RankStarted",
    "RankOutput",
    "RankLines",
    "RankEvent",
    "RankExit",
    "NodeLost",
    "Message",
    "Sink",
    "NodeRunner",
]


@dataclass(frozen=True)
class RankStarted:
    rank: int
    pid: int


@dataclass(frozen=True)
class RankOutput:
    """One line of a rank's stdout or stderr, without its line ending."""

    rank: int
    stream: Literal["stdout", "stderr"]
    text: str

    @property
    def lines(self) -> tuple[str]:
        """A run of one line (what consumers of `RankLines` read)."""
        return (self.text,)


@dataclass(frozen=True)
class RankLines:
    """Consecutive lines of one rank's stdout or stderr, in order, without their line endings:
    what a runner read in one go (one message per read instead of one per line -- a message per
    line cost the launcher more CPU than the ranks spent printing). `lines` belongs to the
    message: nobody changes it after posting."""

    rank: int
    stream: Literal["stdout", "stderr"]
    lines: Sequence[str]


@dataclass(frozen=True)
class RankEvent:
    rank: int
    event: Mapping[str, Any]


@dataclass(frozen=True)
class RankExit:
    """`returncode` in Popen's convention: >= 0 exit status, -N killed by signal N."""

    rank: int
    returncode: int


@dataclass(frozen=True)
class NodeLost:
    """A node stopped answering (connection dropped, agent silent); its ranks are gone."""

    node_rank: int
    reason: str


Message = RankStarted | RankOutput | RankLines | RankEvent | RankExit | NodeLost
Sink = Callable[[Message], None]


class NodeRunner(Protocol):
    """Starts and controls one node's ranks (Contract 5)."""

    node: NodePlan

    def start(self, sink: Sink) -> None:
        """Start every rank of the node (called on the launcher's main thread). Raises
        LaunchError when the node cannot start; from then on reports through `sink`, from any
        thread: RankStarted, RankLines (or RankOutput: one line), RankEvent, then exactly one
        RankExit per rank (or a NodeLost)."""
        ...

    def signal(self, sig: int, *, tree: bool = True) -> None:
        """Send `sig` to every live rank: to its whole process group when `tree`, else to the
        rank process alone (SIGUSR1 asks for a stack dump; other processes would die of it)."""
        ...

    def kill(self) -> None:
        """SIGKILL every process of the node's ranks, grandchildren included. Idempotent."""
        ...

    def close(self) -> None:
        """Release threads, pipes and connections; called once, after `kill`."""
        ...
