"""The scale simulation transport: many nodes on one machine, the launcher's real code path.

Nothing on the launcher's side is simulated: the plan, the supervisor, the console, the log
files, fail-fast and the heartbeats are the ones of a real job. What is simulated is the far
side: each node is a real node agent (`launch/agent.py`, speaking `launch/wire.py`) whose ranks
are synthetic (`launch/synthetic.py`), hosted many to a process (`launch/simhost.py`), reached
over one Unix-socket link per node (`launch/link.py`), with injected connect latency, refused
connects, version mismatches, silent nodes and cut links (`synthetic.Scenario`).

    cluster = SimCluster.start(num_nodes, scenario)
    plan = sim_plan(num_nodes, ranks_per_node)
    plan, runners = prepare(plan, cluster, parallelism=64)   # connect fan-out + preflight
    result = Supervisor(plan, runners, console, ...).run()
    totals = cluster.close()                                  # {"ranks_left": 0, ...}
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from zerorun.errors import LaunchError
from zerorun.launch import fdlimit, wire
from zerorun.launch.agent_runner import AgentRunner
from zerorun.launch.fanout import DEFAULT_PARALLELISM, NodeFailure, failure_table, fan_out
from zerorun.launch.hosts import Host
from zerorun.launch.knobs import heartbeat_timeout
from zerorun.launch.link import Link, LinkHub
from zerorun.launch.plan import DeviceInfo, LaunchOptions, LaunchPlan, Target, build_plan
from zerorun.launch.synthetic import Scenario

__all__ = ["SimCluster", "sim_plan", "prepare", "prepare_job", "Scenario"]

_READY_TIMEOUT_S = 60.0


def sim_plan(num_nodes: int, ranks_per_node: int, *, run_id: str = "sim", target: Target | None = None) -> LaunchPlan:
    """A CPU plan over `num_nodes` simulated hosts named sim-0000, sim-0001, ..."""
    hosts = [Host(f"sim-{i:04d}", tuple(range(ranks_per_node))) for i in range(num_nodes)]
    options = LaunchOptions(target=target or Target(script="train.py"), device="cpu")
    return build_plan(options, hosts, DeviceInfo(gpus=(), cores=os.cpu_count() or 1), master_port=29500, run_id=run_id)


@dataclass
class SimCluster:
    """The agent host processes of one simulated cluster and their sockets."""

    scenario: Scenario
    num_nodes: int
    directory: str
    sockets: list[str]
    procs: list[subprocess.Popen[bytes]]
    per_process: int
    hub: LinkHub = field(default_factory=LinkHub)
    totals: dict[str, Any] | None = None

    @classmethod
    def start(cls, num_nodes: int, scenario: Scenario, *, python: str = sys.executable) -> SimCluster:
        # Up to 16 host processes: the agents' side must not be what limits the measurement
        # (each real node has CPUs of its own; here they share the launcher's machine).
        per = scenario.agents_per_process or max(1, math.ceil(num_nodes / 16))
        count = math.ceil(num_nodes / per)
        directory = tempfile.mkdtemp(prefix="zerorun-sim-")
        with open(os.path.join(directory, "scenario.json"), "w", encoding="utf-8") as fh:
            json.dump(scenario.to_json(), fh)
        procs: list[subprocess.Popen[bytes]] = []
        sockets = [os.path.join(directory, f"host{i}.sock") for i in range(count)]
        try:
            for i, path in enumerate(sockets):
                err = open(os.path.join(directory, f"host{i}.err"), "wb")  # noqa: SIM115 - the child keeps it
                procs.append(
                    subprocess.Popen(
                        [python, "-m", "zerorun.launch.simhost", "--socket", path, "--scenario",
                         os.path.join(directory, "scenario.json")],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                    )
                )
                err.close()
            deadline = time.monotonic() + _READY_TIMEOUT_S
            for i, proc in enumerate(procs):
                assert proc.stdout is not None
                line = proc.stdout.readline()
                if line.strip() != b"ready" or time.monotonic() > deadline:
                    raise LaunchError(f"simulated agent host {i} did not start: {_tail(directory, i)}")
        except BaseException:
            for proc in procs:
                proc.kill()
                proc.wait()
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return cls(scenario, num_nodes, directory, sockets, procs, per)

    def socket_for(self, node_rank: int) -> str:
        return self.sockets[node_rank // self.per_process]

    def connect(self, node_rank: int, name: str, attempt: int, timeout: float) -> Link:
        """One connection attempt to a node (the stand-in for SSH's connect + handshake)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(self.socket_for(node_rank))
            sock.sendall(wire.encode("attach", node_rank=node_rank, attempt=attempt))
            first = b""
            while not first.endswith(b"\n"):
                chunk = sock.recv(1)
                if not chunk:
                    raise NodeFailure("unreachable", f"{name}: connection refused", transient=True)
                first += chunk
        except TimeoutError:
            sock.close()
            raise NodeFailure("timeout", f"{name}: no answer within {timeout:g} s", transient=True) from None
        except NodeFailure:
            sock.close()
            raise
        except OSError as err:
            sock.close()
            raise NodeFailure("unreachable", f"{name}: {err.strerror or err}", transient=True) from None
        link = Link(name, sock)
        self.hub.add(link)
        return link

    def close(self, timeout: float = 15.0) -> dict[str, Any]:
        """Tell every host the job is over; sum their totals (`ranks_left`: synthetic ranks
        still alive when the launcher was done, i.e. left behind; must be 0)."""
        totals: dict[str, Any] = {"agents": 0, "agents_left": 0, "ranks_started": 0, "ranks_left": 0,
                                  "refused": 0, "hosts": len(self.procs), "hosts_failed": 0}
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
                proc.stdin = None  # communicate() must not flush it
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            data = _last_json(out)
            if proc.returncode != 0 or data is None:
                totals["hosts_failed"] += 1
                continue
            for k in ("agents", "agents_left", "ranks_started", "ranks_left", "refused"):
                totals[k] += int(data.get(k, 0))
        self.hub.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        self.totals = totals
        return totals


def prepare(
    plan: LaunchPlan,
    cluster: SimCluster,
    *,
    parallelism: int = DEFAULT_PARALLELISM,
    connect_timeout_s: float = 10.0,
    retries: int = 2,
    backoff_s: float = 0.2,
    heartbeat_s: float = 1.0,
    heartbeat_timeout_s: float = 10.0,
    preflight_timeout_s: float = 60.0,
) -> tuple[LaunchPlan, list[AgentRunner]]:
    """Connect to every node (bounded fan-out, retries), run the preflight on every agent, and
    return the plan with the master port the master picked, plus one runner per node. Nothing
    starts before every node passed; failures raise one LaunchError with the failure table."""

    names = {n.node_rank: n.host.name for n in plan.nodes}
    fdlimit.check(len(names), f"links to {len(names)} simulated nodes")
    links, failures = fan_out(
        names,
        lambda r, attempt: cluster.connect(r, names[r], attempt, connect_timeout_s),
        parallelism=parallelism,
        retries=retries,
        backoff_s=backoff_s,
    )
    try:
        if failures:
            raise LaunchError(failure_table(failures, names=names) + "\nNothing was started.")
        for r, link in links.items():
            link.send("preflight", **wire.preflight_fields(check_port=None, pick_port=r == 0, script=None))
        hellos, bad = wire.collect_hellos(
            links, time.monotonic() + preflight_timeout_s, python=sys.executable,
            silent=lambda r: ("timeout", "the node agent did not answer the preflight"),
        )
        if bad:
            raise LaunchError(failure_table(bad, what="The preflight", names=names) + "\nNothing was started.")
        port = int(hellos[0].get("port") or plan.master_port)
        plan = plan.with_master("127.0.0.1", port)
        runners = [
            AgentRunner(plan, node, links[node.node_rank], heartbeat_s=heartbeat_s, heartbeat_timeout_s=heartbeat_timeout_s)
            for node in plan.nodes
        ]
        return plan, runners
    except BaseException:
        for link in links.values():
            link.close()
        raise


class _SimRunner(AgentRunner):
    """An `AgentRunner` of `--launcher sim`: the last one closed stops the simulated cluster."""

    def __init__(self, runner: AgentRunner, cluster: SimCluster, open_runners: list[int]) -> None:
        super().__init__(runner.plan, runner.node, runner.channel,
                         heartbeat_s=runner.heartbeat_s, heartbeat_timeout_s=runner.heartbeat_timeout_s)
        self._cluster = cluster
        self._open = open_runners

    def close(self) -> None:
        super().close()
        self._open[0] -= 1
        if self._open[0] == 0:
            totals = self._cluster.close()
            if totals["ranks_left"] or totals["hosts_failed"]:
                print(f"zerorun: simulated cluster: {totals}", file=sys.stderr)


def prepare_job(plan: LaunchPlan, options: Any) -> tuple[LaunchPlan, list[AgentRunner]]:
    """`--launcher sim`: the plan's nodes simulated on this machine. The scenario is the JSON
    file named by `ZERORUN_SIM_SCENARIO` (a `Scenario`; default: 1 line per rank per second,
    a memory and a status event every 5 s, every rank exits 0 after 10 s); the script is not
    run. Everything on the launcher's side is the real job's code."""
    path = os.environ.get("ZERORUN_SIM_SCENARIO")
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                scenario = Scenario.from_json(json.load(fh))
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise LaunchError(f"ZERORUN_SIM_SCENARIO={path}: cannot read the scenario ({err}).") from None
    else:
        scenario = Scenario(line_rate=1.0, event_interval_s=5.0, duration_s=10.0)
    cluster = SimCluster.start(len(plan.nodes), scenario)
    try:
        timeout = heartbeat_timeout()
        plan, runners = prepare(plan, cluster, parallelism=getattr(options, "ssh_parallelism", None) or DEFAULT_PARALLELISM,
                                heartbeat_timeout_s=timeout)
    except BaseException:
        cluster.close()
        raise
    count = [len(runners)]
    return plan, [_SimRunner(r, cluster, count) for r in runners]


def _last_json(out: bytes | None) -> dict[str, Any] | None:
    for line in reversed((out or b"").splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict):
            return data
    return None


def _tail(directory: str, i: int) -> str:
    try:
        with open(os.path.join(directory, f"host{i}.err"), encoding="utf-8", errors="replace") as fh:
            return fh.read()[-2000:] or "no output"
    except OSError:
        return "no output"
