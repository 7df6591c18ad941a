"""The launcher <-> node agent protocol: one JSON object per line over the SSH channel.

Stdlib only (the agent imports it on every node). The agent reads its stdin and writes its
stdout; the launcher holds the other ends of the SSH channel. Nothing travels on the command
line: no quoting problems, nothing readable in `ps`.

launcher -> agent (`t` is the message type):
- `preflight` {version, protocol, check_port: int|null, pick_port: bool, script: str|null}:
  answered by `hello` (an `error` when the script is missing there or the port is busy).
- `plan` {plan: the LaunchPlan with only this node's entry (`plan_to_dict(plan, node_rank)`;
  `num_nodes` says how many there are), node_rank, heartbeat_s, heartbeat_timeout_s}: start
  this node's ranks (through `launch.local.LocalRunner`).
- `hb` {}: the launcher is alive. No message for `heartbeat_timeout_s` -> the agent kills its
  ranks and exits.
- `signal` {sig, tree}: send a signal to every live rank, its process group when `tree`
  (SIGTERM/SIGINT of a stop), the rank alone otherwise (SIGUSR1: stack dumps).
- `kill` {}: SIGKILL every process of the node's ranks (the end of the grace period).
- EOF on stdin: the launcher is gone or done -> kill every rank at once and exit.

agent -> launcher:
- `hello` {version, python, hostname, pid, server_addr, client_addr, port, error, error_kind}:
  `server_addr` is the address the launcher reached this node at (from SSH_CONNECTION),
  `client_addr` the launcher's address as this node sees it; `port` the master port checked
  free (or picked), `error` a preflight problem on this node (port busy, script missing), and
  `error_kind` which (`port`, `script`: the launcher's failure table says so).
- `started` {rank, pid}; `out` {rank, stream: "stdout"|"stderr", line}; `lines` {runs:
  [[rank, stream, [line, ...]], ...]} (runs of consecutive lines of one rank's stream, in
  order: the agent batches what its reader read in one turn, `agent.LineBatcher`);
  `event` {rank, event};
  `exit` {rank, code} (negative: killed by that signal, as in subprocess); `hb` {};
  `error` {message}: the agent itself failed (cannot start a rank, bad plan).
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from zerorun.launch.messages import RankEvent, RankExit, RankLines, RankOutput, RankStarted

if TYPE_CHECKING:  # pragma: no cover
    from zerorun.launch.fanout import Failed

K = TypeVar("K", bound=Hashable)

__all__ = [
    "PROTOCOL_VERSION",
    "encode",
    "decode",
    "message_from_wire",
    "message_to_wire",
    "messages_from_wire",
    "preflight_fields",
    "wait_hello",
    "hello_problem",
    "collect_hellos",
    "plan_to_dict",
    "plan_from_dict",
]

# Bumped when a message changes meaning; the preflight refuses a mismatch.
# 2: agents send `lines` (batches of one rank's lines), which a version-1 launcher would drop.
PROTOCOL_VERSION = 2


def encode(kind: str, **fields: Any) -> bytes:
    return (json.dumps({"t": kind, **fields}, separators=(",", ":"), default=str) + "\n").encode("utf-8")


def decode(line: bytes | str) -> dict[str, Any] | None:
    """One line -> message, or None when the line is not a protocol message (e.g. a banner a
    login script printed before the agent started)."""
    try:
        msg = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        return None
    return msg


# --- the preflight ---------------------------------------------------------------------------
# One exchange for every transport that starts agents (SSH, srun/mpirun dial-in, the simulation).


def preflight_fields(*, check_port: int | None, pick_port: bool, script: str | None) -> dict[str, Any]:
    """The fields of a `preflight` message (this launcher's version and protocol included)."""
    from zerorun._version import __version__

    return {
        "version": __version__,
        "protocol": PROTOCOL_VERSION,
        "check_port": check_port,
        "pick_port": pick_port,
        "script": script,
    }


def wait_hello(messages: queue.Queue[dict[str, Any] | None], deadline: float) -> dict[str, Any] | None:
    """The agent's `hello` from its message queue (anything before it is skipped), or None when
    the channel closed first or `deadline` (time.monotonic) passed: compare the clock with the
    deadline to tell which."""
    while True:
        try:
            msg = messages.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if msg is None or msg.get("t") == "hello":
            return msg


def hello_problem(msg: Mapping[str, Any], *, version: str, python: str, hint: str = "") -> tuple[str, str] | None:
    """What is wrong with an agent's `hello`, as (kind, text): "version" (another zerorun or
    protocol there than this launcher's `version`; `hint` follows the advice) or the node's own
    error (its `error_kind`: "port" busy, "script" missing; "preflight" when it says no kind).
    None when it is good."""
    if msg.get("version") != version or msg.get("protocol") != PROTOCOL_VERSION:
        return "version", (
            f"{python} there imports zerorun {msg.get('version')}, this launcher is zerorun {version}. "
            f"Install the same version on every node{hint}."
        )
    if msg.get("error"):
        return str(msg.get("error_kind") or "preflight"), str(msg["error"])
    return None


def collect_hellos(
    inboxes: Mapping[K, Any],
    deadline: float,
    *,
    python: str,
    silent: Callable[[K], tuple[str, str]],
    hint: str = "",
) -> tuple[dict[K, dict[str, Any]], dict[K, Failed[K]]]:
    """Every agent's answer to the preflight, judged: (the good `hello`s, the failures for
    `fanout.failure_table`). `inboxes` maps a node to what holds its agent's messages (`.messages`:
    an `agent_runner.AgentInbox`); each `hello` is awaited until `deadline` (time.monotonic)
    and checked against this launcher (`hello_problem`: zerorun version and protocol,
    the node's own error). `silent(node)` -> (category, message) for an agent that did not
    answer: compare the clock with `deadline` to tell silence from an ended stream.
    One loop for SSH, the Slurm/MPI dial-in and the simulation."""
    from zerorun._version import __version__
    from zerorun.launch.fanout import Failed

    hellos: dict[K, dict[str, Any]] = {}
    failures: dict[K, Failed[K]] = {}
    for node, inbox in inboxes.items():
        msg = wait_hello(inbox.messages, deadline)
        if msg is None:
            failures[node] = Failed(node, *silent(node), 1)
            continue
        problem = hello_problem(msg, version=__version__, python=python, hint=hint)
        if problem is not None:
            failures[node] = Failed(node, problem[0], problem[1], 1)
        else:
            hellos[node] = msg
    return hellos, failures


# --- a rank's messages on the wire -----------------------------------------------------------
# One codec for every hop a rank's `started`/`out`/`event`/`exit` takes: agent -> launcher (SSH,
# dial-in, simulation) and node <-> node in per-node mode.

RankMessage = RankOutput | RankLines | RankEvent | RankStarted | RankExit


def message_to_wire(m: object) -> tuple[str, dict[str, Any]] | None:
    """(kind, fields) of a rank's runner message; None for anything else (e.g. `NodeLost`)."""
    if isinstance(m, RankLines):
        return "lines", {"runs": [[m.rank, m.stream, list(m.lines)]]}
    if isinstance(m, RankOutput):
        return "out", {"rank": m.rank, "stream": m.stream, "line": m.text}
    if isinstance(m, RankEvent):
        return "event", {"rank": m.rank, "event": dict(m.event)}
    if isinstance(m, RankStarted):
        return "started", {"rank": m.rank, "pid": m.pid}
    if isinstance(m, RankExit):
        return "exit", {"rank": m.rank, "code": m.returncode}
    return None


def message_from_wire(msg: Mapping[str, Any]) -> RankMessage | None:
    """The runner message of a decoded `started`/`out`/`event`/`exit`; None for other kinds.
    A malformed one (a field missing or of the wrong type) raises KeyError, TypeError or
    ValueError: the caller says so instead of losing its reader thread."""
    kind = msg.get("t")
    if kind == "out":
        stream = str(msg["stream"])
        if stream not in ("stdout", "stderr"):
            raise ValueError(f"unknown stream {stream!r}")
        return RankOutput(int(msg["rank"]), stream, str(msg["line"]))  # type: ignore[arg-type]
    if kind == "event":
        if not isinstance(msg.get("event"), dict):
            raise TypeError("an event message without an event object")
        return RankEvent(int(msg["rank"]), msg["event"])
    if kind == "started":
        return RankStarted(int(msg["rank"]), int(msg["pid"]))
    if kind == "exit":
        return RankExit(int(msg["rank"]), int(msg["code"]))
    return None


def messages_from_wire(msg: Mapping[str, Any]) -> list[RankMessage]:
    """`message_from_wire` for every kind an agent sends, `lines` included (one RankLines per
    run, in order; an empty run is dropped); an empty list for kinds that carry no rank
    message. Malformed: raises as `message_from_wire` does."""
    if msg.get("t") != "lines":
        m = message_from_wire(msg)
        return [] if m is None else [m]
    out: list[RankMessage] = []
    for rank, stream, lines in msg["runs"]:
        if stream not in ("stdout", "stderr"):
            raise ValueError(f"unknown stream {stream!r}")
        if not isinstance(lines, list):
            raise TypeError("a run of lines that is not a list")
        r = int(rank)
        try:
            "".join(lines)  # JSON strings are str; this raises for anything else (a faulty sender)
        except TypeError:
            lines = [str(line) for line in lines]
        if lines:
            out.append(RankLines(r, stream, lines))
    return out


# --- the plan on the wire -------------------------------------------------------------------
# The agent rebuilds the launcher's LaunchPlan and hands it to `launch.local.LocalRunner`, so
# a remote node starts ranks with exactly the code (and environment layering) of a local one.
# Fields a newer plan has and this side does not know are dropped; missing ones take their
# defaults, so the codec survives additive changes to the plan's dataclasses.


def plan_to_dict(plan: Any, node_rank: int | None = None) -> dict[str, Any]:
    """The plan as JSON-able data. With `node_rank`, only that node's entry travels (plus
    `num_nodes`): an agent needs its own ranks, not the 8,000 rank specs of a 1,000-node job
    (the whole plan per node would be ~1 MB of JSON each, a GB in all)."""
    import dataclasses

    if node_rank is None:
        data = dataclasses.asdict(plan)
        data["omp_threads"] = {str(k): v for k, v in dict(plan.omp_threads).items()}
        data["num_nodes"] = len(plan.nodes)
        return data
    # Everything but the nodes is the same for every node: converted once per plan.
    global _skeleton
    if _skeleton is None or _skeleton[0] is not plan:
        base = dataclasses.asdict(dataclasses.replace(plan, nodes=()))
        base["omp_threads"] = {str(k): v for k, v in dict(plan.omp_threads).items()}
        base["num_nodes"] = len(plan.nodes)
        _skeleton = (plan, base)
    return {**_skeleton[1], "nodes": [_data(plan.nodes[node_rank])]}


_skeleton: tuple[Any, dict[str, Any]] | None = None


def _data(obj: Any) -> Any:
    """`dataclasses.asdict` without its deep copies (read-only data about to become JSON):
    ~10x faster, which counts once per node of a 1,000-node job."""
    if hasattr(obj, "__dataclass_fields__") and not isinstance(obj, type):
        return {name: _data(getattr(obj, name)) for name in obj.__dataclass_fields__}
    if isinstance(obj, (list, tuple)):
        return [_data(v) for v in obj]
    if isinstance(obj, dict) or hasattr(obj, "items"):
        return {k: _data(v) for k, v in obj.items()}
    return obj


def plan_from_dict(data: dict[str, Any]) -> Any:
    import dataclasses

    from zerorun.launch.hosts import Host
    from zerorun.launch.plan import LaunchPlan, NodePlan, RankSpec, Target

    def build(cls: Any, values: dict[str, Any], **override: Any) -> Any:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in values.items() if k in names}
        kwargs.update(override)
        return cls(**kwargs)

    nodes = []
    for n in data["nodes"]:
        host = build(Host, n["host"], slots=tuple(n["host"]["slots"]), env=dict(n["host"].get("env", {})))
        ranks = tuple(build(RankSpec, r) for r in n["ranks"])
        visible = tuple(n["visible_devices"]) if n.get("visible_devices") is not None else None
        nodes.append(build(NodePlan, n, host=host, ranks=ranks, visible_devices=visible, env=dict(n.get("env", {}))))
    total = int(data.get("num_nodes") or len(nodes))
    if total > len(nodes):  # a one-node plan: the other nodes are empty placeholders
        nodes = _NodeList(total, {n.node_rank: n for n in nodes})
    target = build(Target, data["target"], args=tuple(data["target"].get("args", ())))
    omp = {int(k): int(v) for k, v in data.get("omp_threads", {}).items()}
    return build(LaunchPlan, data, nodes=nodes if isinstance(nodes, _NodeList) else tuple(nodes),
                 target=target, omp_threads=omp)


class _NodeList(Sequence[Any]):
    """The nodes of a one-node plan: this node, and placeholders (no ranks) made only when
    looked at -- an agent of a 1,000-node job needs `len()` and its own entry."""

    def __init__(self, total: int, own: dict[int, Any]) -> None:
        self._total = total
        self._own = own

    def __len__(self) -> int:
        return self._total

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(self._total)))
        if i < 0:
            i += self._total
        if not 0 <= i < self._total:
            raise IndexError(i)
        if i not in self._own:
            from zerorun.launch.hosts import Host
            from zerorun.launch.plan import NodePlan

            return NodePlan(i, Host("other-node", ()), (), None)
        return self._own[i]
