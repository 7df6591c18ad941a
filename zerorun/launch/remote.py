"""Remote nodes of a job over SSH: the preflight, then one runner per node.

Built on `launch/ssh.py` (connections, the agent's channel). `prepare(plan, options)` is the
entry point (Contract 5): preflight every remote node, then one `agent_runner.AgentRunner` per
remote node (the runner the Slurm/MPI dial-in and the simulation use over their links).

Nothing starts before every node passed the preflight: reachable and authenticated, the
remote interpreter imports the same zerorun, the remote cwd and the script exist, the GPUs
cover the slots, the master port is free on the master (or picked there).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from zerorun.errors import LaunchError
from zerorun.launch import wire
from zerorun.launch.agent_runner import AgentRunner
from zerorun.launch.fanout import Failed, failure_table
from zerorun.launch.knobs import env_number, heartbeat_timeout
from zerorun.launch.messages import NodeRunner
from zerorun.launch.plan import LaunchOptions, LaunchPlan
from zerorun.launch.ssh import (
    NodeChannel,
    SshOptions,
    agent_command,
    close_client,
    connect_nodes,
)

__all__ = ["Preflight", "preflight", "prepare", "check_devices", "ssh_options_from"]


@dataclass
class Preflight:
    """What the preflight learned: the channels (agents waiting for their plan) and the
    master address/port the ranks will use."""

    channels: dict[str, NodeChannel]
    hellos: dict[str, dict[str, Any]]
    master_addr: str
    master_port: int
    python: str
    cwd: str

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()


def preflight(
    aliases: Sequence[str],
    options: SshOptions,
    *,
    master: str | None,
    master_port: int | None,
    master_addr: str | None = None,
    local_port_check: Callable[[int], str | None] | None = None,
    script: str | None = None,
) -> Preflight:
    """Before any rank starts anywhere: every node reachable and authenticated, the remote
    interpreter runs and imports the same zerorun, the remote cwd exists, the master port is
    free on the master (or picked there when not given). Any failure closes everything and
    raises one LaunchError naming the hosts.

    `master` is the alias of the master node when it is remote (None: the launcher's machine
    is the master, and `local_port_check` checks the port here). `master_addr` overrides the
    address the ranks use to reach it. `script` (the job's script, if any) must exist on
    every node, relative to the remote cwd.
    """
    python = options.remote_python or sys.executable
    cwd = options.remote_cwd or os.getcwd()
    connections = connect_nodes(aliases, options)
    command = agent_command(python, cwd)
    channels: dict[str, NodeChannel] = {}
    try:
        for alias, (target, client) in connections.items():
            channels[alias] = NodeChannel(alias, target, client, command)
        for alias, ch in channels.items():
            is_master = alias == master
            ch.send(
                "preflight",
                **wire.preflight_fields(
                    check_port=master_port if is_master else None,
                    pick_port=is_master and master_port is None,
                    script=script,
                ),
            )
        hellos, errors = _collect_hellos(channels, python, cwd, options.preflight_timeout_s)
        if errors:
            names = {alias: ch.target.display for alias, ch in channels.items()}
            raise LaunchError(failure_table(errors, what="The preflight", names=names) + "\nNothing was started.")
        if master is not None:
            hello = hellos[master]
            port = int(hello["port"])
            addr = master_addr or hello.get("server_addr") or channels[master].target.hostname
        else:
            if master_port is None:
                raise LaunchError("internal: a local master needs its port chosen before the preflight")
            problem = local_port_check(master_port) if local_port_check else None
            if problem:
                here = {"this machine": Failed("this machine", "port", problem, 1)}
                raise LaunchError(failure_table(here, what="The preflight") + "\nNothing was started.")
            port = master_port
            # The launcher's address as the remote nodes see it (they all reached us on it).
            seen = {h.get("client_addr") for h in hellos.values() if h.get("client_addr")}
            addr = master_addr or (seen.pop() if len(seen) == 1 else "")
            if not addr:
                raise LaunchError(
                    "this machine is the master, but the nodes reach it at different addresses "
                    f"({', '.join(sorted(str(s) for s in seen))}); pass --master_addr with the one every node can reach."
                )
        return Preflight(channels, hellos, addr, port, python, cwd)
    except BaseException:
        for ch in channels.values():
            ch.close()
        for _, client in connections.values():
            close_client(client)
        raise


def _collect_hellos(
    channels: dict[str, NodeChannel], python: str, cwd: str, timeout: float
) -> tuple[dict[str, dict[str, Any]], dict[str, Failed[str]]]:
    """Every node's `hello`, or what went wrong there (`fanout.Failed`, for `failure_table`)."""
    deadline = time.monotonic() + timeout

    def silent(alias: str) -> tuple[str, str]:
        if time.monotonic() >= deadline:
            return "timeout", f"the node agent did not answer within {timeout:g} s"
        return _explain_early_exit(channels[alias], python, cwd)

    hint = " (or point --remote_python at an environment that has it)"
    return wire.collect_hellos(channels, deadline, python=python, silent=silent, hint=hint)


def _explain_early_exit(ch: NodeChannel, python: str, cwd: str) -> tuple[str, str]:
    """(category, message) of an agent that exited before answering."""
    code = ch.exit_status()
    tail = "\n".join(ch.stderr_tail[-8:])
    if "No module named" in tail and "zerorun" in tail:
        return "zerorun", (
            f"{python} there cannot import zerorun. Install zerorun on every node "
            "(or point --remote_python at an environment that has it)."
        )
    if code == 127 or "No such file or directory" in tail and python in tail:
        return "python", (
            f"the remote interpreter {python} does not exist there. Pass "
            "--remote_python with the python that has zerorun installed on the nodes."
        )
    if "cd:" in tail or cwd in tail:
        return "cwd", (
            f"cannot enter the working directory {cwd} there. Pass --remote_cwd with a "
            "directory that exists on every node (the script's path is resolved from it)."
        )
    detail = f": {' | '.join(ch.stderr_tail[-3:])}" if tail else ""
    return "agent", f"the node agent exited with status {code} before answering{detail}"


def ssh_options_from(options: LaunchOptions) -> SshOptions:
    """The SSH part of `launch.plan.LaunchOptions` (+ the heartbeat timeout, and
    ZERORUN_SSH_PARALLELISM / ZERORUN_SSH_CONNECT_TIMEOUT where the options leave them out;
    `launch/knobs.py`)."""
    parallelism = options.ssh_parallelism or env_number(
        ("ZERORUN_SSH_PARALLELISM",), SshOptions.parallelism, minimum=1, integer=True
    )
    connect = options.ssh_connect_timeout or env_number(("ZERORUN_SSH_CONNECT_TIMEOUT",), None, minimum=0.1)
    return SshOptions(
        remote_python=options.remote_python,
        remote_cwd=options.remote_cwd,
        accept_new_hosts=bool(options.ssh_accept_new_hosts),
        heartbeat_timeout_s=heartbeat_timeout(),
        parallelism=int(parallelism or SshOptions.parallelism),
        connect_timeout=connect,
        port=options.ssh_port,
    )


def prepare(
    plan: LaunchPlan, options: LaunchOptions, *, ssh: SshOptions | None = None
) -> tuple[LaunchPlan, list[NodeRunner]]:
    """Preflight every remote node of `plan`, then return the plan with the master address and
    port the ranks must use, and one runner per node (LocalRunner for this machine's node).

    Nothing starts before every node passed; a failure raises LaunchError naming the hosts.
    """
    from zerorun.launch.local import LocalRunner

    ssh = ssh or ssh_options_from(options)
    remote = [n for n in plan.nodes if not n.is_local]
    if not remote:
        return plan, [LocalRunner(plan, node) for node in plan.nodes]
    try:
        import paramiko  # noqa: F401 - only checking it is there
    except ImportError:
        raise LaunchError(
            "jobs on remote nodes need paramiko, which is not installed in this environment: "
            f"`{os.path.basename(sys.executable)} -m pip install paramiko` (zerorun's own dependency)."
        ) from None
    master_node = plan.nodes[0]
    master = None if master_node.is_local else master_node.host.name
    pf = preflight(
        [n.host.name for n in remote],
        ssh,
        master=master,
        master_port=options.master_port if master is not None else plan.master_port,
        master_addr=options.master_addr,
        script=plan.target.script,
        local_port_check=_local_port_problem,
    )
    try:
        auto = getattr(options, "device", None) in (None, "auto")
        if auto:  # the device each node has, not the launcher's (launch/node_devices.py)
            from zerorun.launch.node_devices import adopt_node_devices

            plan = adopt_node_devices(plan, {h: int(v.get("gpus") or 0) for h, v in pf.hellos.items()})
        check_devices(plan, pf.hellos, auto=auto)
        plan = plan.with_master(pf.master_addr, pf.master_port)
        plan = _with_cwd(plan, pf.cwd)
        runners: list[NodeRunner] = []
        for node in plan.nodes:
            if node.is_local:
                runners.append(LocalRunner(plan, node))
            else:
                runners.append(AgentRunner(plan, node, pf.channels[node.host.name],
                                           heartbeat_s=ssh.heartbeat_s, heartbeat_timeout_s=ssh.heartbeat_timeout_s))
        return plan, runners
    except BaseException:
        pf.close()
        raise


def _local_port_problem(port: int) -> str | None:
    from zerorun.launch.agent import port_in_use

    if port_in_use(port):
        return (
            f"master port {port} is already in use on this machine, where rank 0 runs (another "
            "job?). Pick another with --master_port, or leave it out to have a free one chosen."
        )
    return None


def check_devices(plan: LaunchPlan, hellos: dict[str, dict[str, Any]], *, auto: bool) -> None:
    """The plan's device against the GPUs each node reported: a slot beyond a node's GPUs is
    an error, and so is a CPU job on GPU nodes that only happened because the launcher's own
    machine has no GPU (`--device auto` on a login node)."""
    problems: dict[str, Failed[str]] = {}
    gpu_nodes: list[str] = []
    for node in plan.nodes:
        hello = hellos.get(node.host.name)
        if hello is None:
            continue
        gpus = int(hello.get("gpus") or 0)
        if gpus:
            gpu_nodes.append(node.host.name)
        if plan.device == "cuda" and node.host.slots and max(node.host.slots) >= gpus:
            problems[node.host.name] = Failed(node.host.name, "GPUs", (
                f"{node.host.name} has {gpus} GPU(s), but the job uses its slot(s) "
                f"{', '.join(map(str, node.host.slots))}. Lower slots= in the hostfile or select "
                "fewer with --include/--num_gpus."
            ), 1)
    if plan.device == "cpu" and auto and gpu_nodes:
        problems["this machine"] = Failed("this machine", "device", (
            f"the nodes have GPUs ({', '.join(gpu_nodes)}) but this machine has none, so the job "
            "would run on CPU. Pass --device cuda to use the nodes' GPUs (or --device cpu to run "
            "on CPU anyway)."
        ), 1)
    if problems:
        raise LaunchError(failure_table(problems, what="The device check") + "\nNothing was started.")


def _with_cwd(plan: LaunchPlan, cwd: str) -> LaunchPlan:
    return replace(plan, cwd=cwd)
