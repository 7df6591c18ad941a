"""Per-node mode's rendezvous: the zerorun processes of a job (one per node, started by a
scheduler) meet on node 0 over TCP, then stay connected for cluster-wide fail-fast.

Stdlib only (no torch on the launcher path). Node 0 is the hub: it listens on the rendezvous
port (distinct from the ranks' MASTER_PORT), every other node connects to it.

Meeting (`meet`):
- node r -> hub: `join` {node_rank, nnodes, version, protocol, hostname, nproc, device}
- hub -> node r: `welcome` {run_id, nodes: [the join of every node, by node rank], device} once
  every node joined, or `refuse` {message} (a second node 3, another zerorun version, another
  node count, mixed devices, the ranks' master port busy on node 0). A node missing when
  `rdzv_timeout` runs out makes the hub refuse everyone, naming the missing node ranks; a node
  that cannot reach the hub in that time says so.

Running (`Session.runners(plan)`): every node runs its own ranks with `LocalRunner`, and the
other nodes appear to its supervisor as `PeerRunner`s fed over the links:
- node r -> hub: its ranks' `started`/`out`/`event`/`exit` (wire.py's agent messages), `hb`.
- hub -> node r: the `started`/`exit` of every other node's ranks, `lost` {node_rank, reason}
  when the hub lost a node, `hb`.
So every node's supervisor sees every rank exit: a failing rank anywhere stops every node
(plain Contract 5 fail-fast), and node 0's console shows every rank's output and the roll-up
of every node's ranks. A link that closes before its node's ranks all exited, or goes silent
for the heartbeat timeout, is a `NodeLost` (a killed zerorun's connection closes at once).
Peers are never signalled: each node stops its own ranks when its supervisor sees the failure.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from zerorun.errors import LaunchError
from zerorun.launch import tcp_link, wire
from zerorun.launch.knobs import heartbeat_timeout
from zerorun.launch.link import Link, LinkHub
from zerorun.launch.messages import NodeLost, RankExit
from zerorun.launch.wire import message_to_wire, messages_from_wire

__all__ = ["NodeInfo", "Session", "meet", "PeerRunner"]

HEARTBEAT_S = 1.0


@dataclass(frozen=True)
class NodeInfo:
    """What a node tells the others when it joins."""

    node_rank: int
    hostname: str
    nproc: int
    device: str  # "cuda" | "cpu", as that node resolved it
    gpus: int = 0


@dataclass
class Session:
    """The meeting's outcome, and the open links (hub: one per other node; others: the hub)."""

    node_rank: int
    nnodes: int
    run_id: str
    device: str
    nodes: list[NodeInfo]
    hub: LinkHub
    links: dict[int, Link] = field(default_factory=dict)
    hb_timeout: float = 10.0

    @property
    def is_hub(self) -> bool:
        return self.node_rank == 0

    def host_names(self) -> list[str]:
        """A name per node for the console: its hostname, made unique when two nodes share one
        (containers often do)."""
        names = [n.hostname for n in self.nodes]
        return [name if names.count(name) == 1 else f"{name}-n{i}" for i, name in enumerate(names)]

    def runners(self, plan: Any, local_runner: Any) -> list[Any]:
        """This node's runner (wrapped so its messages reach the others) and a PeerRunner for
        every other node, in node order."""
        peers = {n.node_rank: PeerRunner(n) for n in plan.nodes if n.node_rank != self.node_rank}
        relay = _Relay(self, plan, peers)
        own = _ReportingRunner(local_runner, relay)
        return [own if n.node_rank == self.node_rank else peers[n.node_rank] for n in plan.nodes]

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.hub.close()


# --- meeting ----------------------------------------------------------------------------------


def meet(
    info: NodeInfo,
    *,
    nnodes: int,
    master_addr: str,
    rdzv_port: int,
    timeout: float,
    run_id: str,
    master_port_check: Callable[[], str | None] | None = None,
) -> Session:
    """Meet the other nodes; raises LaunchError naming what went wrong."""
    if info.node_rank == 0:
        return _host(info, nnodes=nnodes, rdzv_port=rdzv_port, timeout=timeout, run_id=run_id, port_check=master_port_check)
    return _join(info, nnodes=nnodes, master_addr=master_addr, rdzv_port=rdzv_port, timeout=timeout)


def _join_fields(info: NodeInfo, nnodes: int) -> dict[str, Any]:
    from zerorun._version import __version__

    return {
        "node_rank": info.node_rank,
        "nnodes": nnodes,
        "version": __version__,
        "protocol": wire.PROTOCOL_VERSION,
        "hostname": info.hostname,
        "nproc": info.nproc,
        "device": info.device,
        "gpus": info.gpus,
    }


def _host(
    info: NodeInfo, *, nnodes: int, rdzv_port: int, timeout: float, run_id: str, port_check: Callable[[], str | None] | None
) -> Session:
    from zerorun._version import __version__

    try:
        listener = tcp_link.listen(rdzv_port)
    except OSError as err:
        raise LaunchError(
            f"node 0 cannot listen on the rendezvous port {rdzv_port} ({err.strerror or err}); another job "
            "may use it. Pick another with --rdzv_port (or --master_port: the rendezvous uses the next port)."
        ) from None
    joined: dict[int, tuple[Link, NodeInfo]] = {}
    deadline = time.monotonic() + timeout
    hub = LinkHub(heartbeat_s=HEARTBEAT_S)
    try:
        while len(joined) < nnodes - 1:
            link = tcp_link.accept(listener, hub, deadline, name="rdzv")
            if link is None:
                missing = [str(r) for r in range(1, nnodes) if r not in joined]
                message = (
                    f"rendezvous timeout: node(s) {', '.join(missing)} of {nnodes} did not join within "
                    f"{timeout:g} s (--rdzv_timeout) on port {rdzv_port} of node 0. Is zerorun running "
                    "there with the same --nnodes and a --master_addr that reaches this node?"
                )
                for other, _ in joined.values():
                    other.send("refuse", message=message)
                    other.close()
                raise LaunchError(message)
            try:
                msg = link.messages.get(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
            except queue.Empty:
                msg = None
            if msg is None or msg.get("t") != "join":
                link.close()  # a port scanner, a health check: not one of ours
                continue
            problem = _join_problem(msg, nnodes, joined, __version__)
            if problem:
                link.send("refuse", message=problem)
                link.close()
                if msg.get("version") != __version__ or msg.get("nnodes") != nnodes:
                    # The job cannot go on: tell the others too.
                    for other, _ in joined.values():
                        other.send("refuse", message=problem)
                        other.close()
                    raise LaunchError(problem)
                continue
            rank = int(msg["node_rank"])
            joined[rank] = (
                link,
                NodeInfo(rank, str(msg.get("hostname") or f"node{rank}"), int(msg["nproc"]), str(msg["device"]), int(msg.get("gpus") or 0)),
            )
    except BaseException:
        for other, _ in joined.values():
            other.close()
        hub.close()
        raise
    finally:
        listener.close()

    nodes = [info] + [joined[r][1] for r in range(1, nnodes)]
    links = {r: link for r, (link, _) in joined.items()}
    problem = _device_problem(nodes) or (port_check() if port_check else None)
    if problem:
        for link in links.values():
            link.send("refuse", message=problem)
            link.close()
        hub.close()
        raise LaunchError(problem)
    device = nodes[0].device
    welcome = {"run_id": run_id, "device": device, "nodes": [n.__dict__ for n in nodes]}
    for link in links.values():
        link.send("welcome", **welcome)
    return Session(0, nnodes, run_id, device, nodes, hub, links, heartbeat_timeout())


def _join_problem(msg: Mapping[str, Any], nnodes: int, joined: Mapping[int, Any], version: str) -> str | None:
    where = f"node {msg.get('node_rank')} ({msg.get('hostname')})"
    if msg.get("version") != version or msg.get("protocol") != wire.PROTOCOL_VERSION:
        return f"{where} runs zerorun {msg.get('version')}, node 0 runs {version}: install the same version on every node."
    if msg.get("nnodes") != nnodes:
        return f"{where} was started with --nnodes {msg.get('nnodes')}, node 0 with --nnodes {nnodes}: give every node the same count."
    rank = msg.get("node_rank")
    if not isinstance(rank, int) or not 1 <= rank < nnodes:
        return f"{where}: node rank {rank!r} is not between 1 and {nnodes - 1} (node 0 is the master)."
    if rank in joined:
        return (
            f"{where}: node rank {rank} joined twice (the first from {joined[rank][1].hostname}); every "
            "node needs its own --node_rank."
        )
    if not isinstance(msg.get("nproc"), int) or msg["nproc"] < 1:
        return f"{where}: it has no rank to run (nproc {msg.get('nproc')!r})."
    return None


def _device_problem(nodes: Sequence[NodeInfo]) -> str | None:
    devices = {n.device for n in nodes}
    if len(devices) == 1:
        return None
    listing = ", ".join(f"node {n.node_rank} ({n.hostname}): {n.device}" for n in nodes)
    return (
        f"the nodes disagree on the device ({listing}): one job runs on one kind. Pass the same "
        "--device to every node (--device cpu to run CPU ranks everywhere)."
    )


def _join(info: NodeInfo, *, nnodes: int, master_addr: str, rdzv_port: int, timeout: float) -> Session:
    deadline = time.monotonic() + timeout
    hub = LinkHub(heartbeat_s=HEARTBEAT_S)
    try:
        link = tcp_link.connect(master_addr, rdzv_port, hub, deadline, name="node 0")
    except OSError as err:
        hub.close()
        raise LaunchError(
            f"rendezvous timeout: node {info.node_rank} could not reach node 0 at {master_addr}:{rdzv_port} "
            f"within {timeout:g} s (--rdzv_timeout; last error: {err.strerror or err}). Is zerorun running "
            "there with --node_rank 0, and does --master_addr name it?"
        ) from None
    link.send("join", **_join_fields(info, nnodes))
    # The hub answers when everyone is there, or refuses at its own deadline (which started no
    # later than ours): allow a little more, so its reason arrives rather than ours.
    try:
        msg = link.messages.get(timeout=max(0.0, deadline - time.monotonic()) + 10.0)
    except queue.Empty:
        link.close()
        hub.close()
        raise LaunchError(
            f"rendezvous timeout: node 0 at {master_addr}:{rdzv_port} did not start the job within "
            f"{timeout:g} s (--rdzv_timeout): other nodes are missing."
        ) from None
    if msg is None or msg.get("t") == "refuse":
        link.close()
        hub.close()
        why = msg.get("message") if msg else "node 0 closed the connection during the rendezvous"
        raise LaunchError(f"the rendezvous failed: {why}")
    if msg.get("t") != "welcome":
        link.close()
        hub.close()
        raise LaunchError(f"the rendezvous failed: unexpected message {msg.get('t')!r} from node 0")
    nodes = [NodeInfo(**{k: v for k, v in n.items() if k in NodeInfo.__dataclass_fields__}) for n in msg["nodes"]]
    return Session(info.node_rank, nnodes, str(msg["run_id"]), str(msg["device"]), nodes, hub, {0: link}, heartbeat_timeout())


def local_info(node_rank: int, nproc: int, device: str, gpus: int) -> NodeInfo:
    return NodeInfo(node_rank, socket.gethostname(), nproc, device, gpus)


# --- running -----------------------------------------------------------------------------------


class PeerRunner:
    """A node run by another zerorun process: its ranks' messages arrive over the links.
    signal/kill do nothing (that node's own supervisor stops its ranks when it sees the same
    failure); a node whose link drops before its ranks exited is lost."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._sink: Callable[[Any], None] | None = None
        self._pending: list[Any] = []
        self._exited: set[int] = set()
        self._lost = False

    def start(self, sink: Callable[[Any], None]) -> None:
        with self._lock:
            self._sink = sink
            pending, self._pending = self._pending, []
        for msg in pending:
            sink(msg)

    def post(self, msg: Any) -> None:
        with self._lock:
            if self._lost:
                return
            if isinstance(msg, RankExit):
                if msg.rank in self._exited:
                    return
                self._exited.add(msg.rank)
            if self._sink is None:
                self._pending.append(msg)
                return
            sink = self._sink
        sink(msg)

    def lose(self, reason: str) -> bool:
        """Report the node lost, unless its ranks all exited already; True when reported."""
        with self._lock:
            if self._lost or len(self._exited) >= len(self.node.ranks):
                return False
            self._lost = True
            msg = NodeLost(self.node.node_rank, reason)
            if self._sink is None:
                self._pending.append(msg)
                return True
            sink = self._sink
        sink(msg)
        return True

    def signal(self, sig: int, *, tree: bool = True) -> None:
        del sig, tree

    def kill(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Relay:
    """Moves messages between this node's ranks, the links and the PeerRunners. Link messages
    are handled on the LinkHub's reader thread; heartbeats on its heartbeat thread."""

    def __init__(self, session: Session, plan: Any, peers: dict[int, PeerRunner]) -> None:
        self.session = session
        self.peers = peers
        self.node_of = {spec.rank: spec.node_rank for spec in plan.ranks}
        self.names = {n.node_rank: n.host.name for n in plan.nodes}
        self._done = threading.Event()

    def start(self) -> None:
        for node_rank, link in self.session.links.items():
            link.last_heard = time.monotonic()
            link.set_handler(lambda msg, r=node_rank: self._on_message(r, msg))
        self.session.hub.beat(self._tick)

    def stop(self) -> None:
        self._done.set()
        self.session.close()

    # own ranks -> the others
    def local(self, m: Any) -> None:
        encoded = message_to_wire(m)
        if encoded is None:
            return
        kind, fields = encoded
        if self.session.is_hub:
            if kind in ("started", "exit"):
                for link in self.session.links.values():
                    link.send(kind, **fields)
        else:
            self.session.links[0].send(kind, **fields)

    def _on_message(self, node_rank: int, msg: dict[str, Any] | None) -> None:
        if msg is None:
            self._on_eof(node_rank)
            return
        kind = msg.get("t")
        if kind == "lost" and not self.session.is_hub:
            peer = self.peers.get(int(msg.get("node_rank", -1)))
            if peer is not None:
                peer.lose(str(msg.get("reason")))
            return
        try:
            got = messages_from_wire(msg)  # a `lines` message: a run per rank stream
        except (KeyError, TypeError, ValueError):
            return
        if not got:
            return
        if self.session.is_hub and kind in ("started", "exit"):
            for other, olink in self.session.links.items():
                if other != node_rank:
                    olink.send(kind, **{k: v for k, v in msg.items() if k != "t"})
        for m in got:
            peer = self.peers.get(self.node_of.get(m.rank, -1))
            if peer is not None:
                peer.post(m)

    def _on_eof(self, node_rank: int) -> None:
        if self._done.is_set():
            return
        if self.session.is_hub:
            self._lose(node_rank, f"the connection to node {node_rank} ({self.names.get(node_rank)}) closed (its zerorun exited or was killed)")
        else:
            for peer in self.peers.values():
                peer.lose("the connection to node 0 (the rendezvous master) closed (its zerorun exited or was killed)")

    def _lose(self, node_rank: int, reason: str) -> None:
        peer = self.peers.get(node_rank)
        if peer is None or not peer.lose(reason):
            return
        for other, link in self.session.links.items():
            if other != node_rank:
                link.send("lost", node_rank=node_rank, reason=reason)

    def _tick(self, now: float) -> None:
        if self._done.is_set():
            return
        for node_rank, link in list(self.session.links.items()):
            if link.closed.is_set():
                continue
            silent = now - link.last_heard
            if silent > self.session.hb_timeout:
                why = f"no heartbeat for {silent:.0f} s (network down or node frozen)"
                if self.session.is_hub:
                    self._lose(node_rank, f"node {node_rank} ({self.names.get(node_rank)}): {why}")
                else:
                    for peer in self.peers.values():
                        peer.lose(f"node 0 (the rendezvous master): {why}")
                link.close()
                continue
            link.send("hb")


class _ReportingRunner:
    """This node's runner: what its ranks say goes to this supervisor and to the other nodes."""

    def __init__(self, inner: Any, relay: _Relay) -> None:
        self.inner = inner
        self.relay = relay
        self.node = inner.node

    def start(self, sink: Callable[[Any], None]) -> None:
        def tee(m: Any) -> None:
            self.relay.local(m)  # first: the others learn of a failure as early as possible
            sink(m)

        self.relay.start()
        self.inner.start(tee)

    def signal(self, sig: int, *, tree: bool = True) -> None:
        self.inner.signal(sig, tree=tree)

    def kill(self) -> None:
        self.inner.kill()

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            self.relay.stop()


def own_node_devices(plan: Any, node_rank: int, gpus: Sequence[str]) -> Any:
    """The plan with this node's CUDA_VISIBLE_DEVICES from its own visible GPUs (the plan was
    built with every node as a remote one: physical indices)."""
    node = plan.nodes[node_rank]
    if node.visible_devices is None or not gpus:
        return plan
    visible = tuple(gpus[int(s)] for s in node.host.slots)
    nodes = list(plan.nodes)
    nodes[node_rank] = replace(node, visible_devices=visible)
    return replace(plan, nodes=tuple(nodes))
