"""Nodes of a Slurm allocation: one `srun` starts a node agent on every node; each agent dials
back to the launcher over TCP and speaks the SSH agents' protocol (`launch/wire.py`).

    srun --nodes=N --ntasks=N --ntasks-per-node=1 --cpu-bind=none --kill-on-bad-exit=1
         --nodelist=HOSTS --chdir=CWD [--overlap] [--slurm_args ...] PYTHON -u -m zerorun.launch.agent --dial

Slurm tracks, accounts for and kills what srun started; zerorun adds the console, fail-fast,
heartbeats and events exactly as over SSH (`link.LinkRunner` drives each agent). srun
broadcasts stdin and merges every task's stdout, so each agent has its own TCP connection:
`ZERORUN_AGENT_DIAL` (the launcher's addresses and port; the agent tries
SLURM_LAUNCH_NODE_IPADDR first) and `ZERORUN_AGENT_TOKEN` (a per-job secret) travel in srun's
environment, never on a command line. Stopping: the agents stop their ranks (fail-fast,
Ctrl-C, grace period, as over SSH), then srun gets SIGTERM (one SIGINT only makes srun print
status); with no task left, Slurm kills whatever srun started.
"""

from __future__ import annotations

import os
import queue
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from zerorun.errors import LaunchError
from zerorun.launch import tcp_link, wire
from zerorun.launch.link import Link, LinkHub, LinkRunner
from zerorun.launch.slurm_env import SlurmEnv, compress_hostlist

__all__ = ["srun_command", "prepare", "local_addresses", "START_TIMEOUT_S"]

# How long the agents get to dial in after srun started (node start-up, a busy controller).
START_TIMEOUT_S = 60.0


def srun_command(
    nodes: Sequence[str],
    *,
    python: str,
    cwd: str,
    in_step: bool,
    slurm_args: str | None = None,
) -> list[str]:
    """The one srun that starts every node's agent (argv, no shell)."""
    n = len(nodes)
    argv = [
        "srun",
        f"--nodes={n}",
        f"--ntasks={n}",
        "--ntasks-per-node=1",
        "--cpu-bind=none",
        "--kill-on-bad-exit=1",
        f"--nodelist={compress_hostlist(list(nodes))}",
        f"--chdir={cwd}",
        "--job-name=zerorun-agents",
    ]
    if in_step:
        argv.append("--overlap")  # inside a step, share its resources rather than wait for them
    if slurm_args:
        try:
            argv += shlex.split(slurm_args)
        except ValueError as err:
            raise LaunchError(f"--slurm_args {slurm_args!r}: {err}.") from None
    return [*argv, python, "-u", "-m", "zerorun.launch.agent", "--dial"]


def local_addresses() -> list[str]:
    """This machine's IPv4 addresses, loopback last (candidates for the agents to dial)."""
    import fcntl
    import struct

    found: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            addr = socket.inet_ntoa(packed[20:24])
            if addr not in found:
                found.append(addr)
    return sorted(found, key=lambda a: a.startswith("127."))


class _Step:
    """The srun process: its output tail, and SIGTERM once every runner closed."""

    def __init__(self, argv: list[str], env: Mapping[str, str], cwd: str) -> None:
        self.argv = argv
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=dict(env),
                cwd=cwd,
                start_new_session=True,  # Ctrl-C reaches zerorun, which stops the step its own way
            )
        except FileNotFoundError:
            raise LaunchError("srun is not installed here (--launcher slurm needs Slurm's client tools).") from None
        self.tail: list[str] = []
        self._open = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="zerorun-srun-output", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            if line:
                self.tail.append(line)
                del self.tail[:-40]

    def describe_exit(self) -> str:
        code = self.proc.poll()
        tail = "\n".join(f"  {line}" for line in self.tail[-10:])
        return f"srun exited with status {code}" + (f":\n{tail}" if tail else "")

    def hold(self) -> None:
        with self._lock:
            self._open += 1

    def release(self) -> None:
        with self._lock:
            self._open -= 1
            last = self._open <= 0
        if last:
            self.stop()

    def stop(self, grace: float = 5.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=5)


class SlurmRunner(LinkRunner):
    """`LinkRunner` whose last `close()` also ends the srun step."""

    def __init__(self, *args: Any, step: _Step, owns_hub: LinkHub | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step = step
        self.owns_hub = owns_hub
        step.hold()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.step.release()
            if self.owns_hub is not None:
                self.owns_hub.close()


def prepare(
    plan: Any,
    options: Any,
    slurm: SlurmEnv,
    *,
    withheld: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> tuple[Any, list[Any]]:
    """Start the agents with srun, run the preflight over their links, return the plan with the
    master the ranks will use and one runner per node. Nothing starts before every node passed;
    a failure stops srun and raises LaunchError naming the nodes.

    srun hands its environment to the agents, whose ranks inherit it (as local ranks inherit the
    launcher's), under each node's `node.env`; `withheld` names (secret-looking variables nobody
    named, `environment.EnvSpec.withheld`) are left out, as over SSH."""
    from zerorun._version import __version__
    from zerorun.launch.remote import check_devices, ssh_options_from
    from zerorun.launch.ssh import join_errors

    env = dict(os.environ if environ is None else environ)
    names = [n.host.name for n in plan.nodes]
    python = options.remote_python or sys.executable
    cwd = options.remote_cwd or plan.cwd
    listener = tcp_link.listen(0)
    port = listener.getsockname()[1]
    token = secrets.token_hex(16)
    addresses = [a for a in [env.get("ZERORUN_LAUNCHER_ADDR", ""), *local_addresses()] if a]
    step_env = {k: v for k, v in env.items() if k not in set(withheld)}
    step_env = {**step_env, "ZERORUN_AGENT_DIAL": f"{','.join(addresses)}:{port}", "ZERORUN_AGENT_TOKEN": token}
    argv = srun_command(names, python=python, cwd=cwd, in_step=slurm.in_step, slurm_args=options.slurm_args)
    hub = LinkHub()
    step = _Step(argv, step_env, cwd)
    links: dict[str, Link] = {}
    try:
        timeout = float(env.get("ZERORUN_SLURM_START_TIMEOUT", START_TIMEOUT_S))
        deadline = time.monotonic() + timeout
        while len(links) < len(names):
            if step.proc.poll() is not None:
                raise LaunchError(
                    f"the node agents did not start ({len(links)} of {len(names)} dialed in): {step.describe_exit()}"
                )
            link = tcp_link.accept(listener, hub, min(deadline, time.monotonic() + 0.5), name="agent")
            if link is None:
                if time.monotonic() >= deadline:
                    missing = [n for n in names if n not in links]
                    raise LaunchError(
                        f"the node agents of {', '.join(missing)} did not dial in to this launcher within "
                        f"{timeout:g} s (ports {port} on {', '.join(addresses)}); a firewall between the nodes and "
                        f"this machine? Set ZERORUN_LAUNCHER_ADDR to an address they can reach. {step.describe_exit() if step.proc.poll() is not None else ''}"
                    )
                continue
            try:
                hello = link.messages.get(timeout=10)
            except queue.Empty:
                hello = None
            node = str(hello.get("node")) if hello and hello.get("t") == "dial" else None
            if hello is None or hello.get("token") != token or node not in names or node in links:
                link.close()  # not one of ours (or a duplicate): ignore
                continue
            link.name = link.display = node
            links[node] = link
        listener.close()

        for i, name in enumerate(names):
            is_master = i == 0
            links[name].send(
                "preflight",
                version=__version__,
                protocol=wire.PROTOCOL_VERSION,
                check_port=options.master_port if is_master else None,
                pick_port=is_master and options.master_port is None,
                script=plan.target.script,
            )
        hellos: dict[str, dict[str, Any]] = {}
        errors: dict[str, str] = {}
        hello_deadline = time.monotonic() + 30
        for name in names:
            msg: dict[str, Any] | None = None
            while True:
                try:
                    msg = links[name].messages.get(timeout=max(0.0, hello_deadline - time.monotonic()))
                except queue.Empty:
                    msg = None
                    break
                if msg is None or msg.get("t") == "hello":
                    break
            if msg is None:
                tail = "; ".join(links[name].stderr_tail[-3:] or step.tail[-3:])
                errors[name] = f"{name}: the node agent did not answer the preflight" + (f" ({tail})" if tail else "")
            elif msg.get("version") != __version__ or msg.get("protocol") != wire.PROTOCOL_VERSION:
                errors[name] = (
                    f"{name}: {python} there imports zerorun {msg.get('version')}, this launcher is zerorun "
                    f"{__version__}. Install the same version on every node."
                )
            elif msg.get("error"):
                errors[name] = f"{name}: {msg['error']}"
            else:
                hellos[name] = msg
        if errors:
            raise LaunchError(join_errors("The preflight", errors) + " Nothing was started.")
        master = hellos[names[0]]
        check_devices(plan, hellos, auto=getattr(options, "device", None) in (None, "auto"))
        addr = options.master_addr or master.get("server_addr") or names[0]
        from dataclasses import replace

        plan = replace(plan.with_master(addr, int(master["port"])), cwd=cwd)
        ssh = ssh_options_from(options)
        runners: list[Any] = []
        for i, node in enumerate(plan.nodes):
            runners.append(
                SlurmRunner(
                    plan,
                    node,
                    links[node.host.name],
                    hub,
                    heartbeat_s=ssh.heartbeat_s,
                    heartbeat_timeout_s=ssh.heartbeat_timeout_s,
                    step=step,
                    owns_hub=hub if i == len(plan.nodes) - 1 else None,
                )
            )
        return plan, runners
    except BaseException:
        listener.close()
        for link in links.values():
            link.close()
        step.stop(grace=2.0)
        hub.close()
        raise


def allocation_hosts(slurm: SlurmEnv, *, num_gpus: int | None, k: int = 1) -> list[Any]:
    """The allocation's nodes as hosts: ranks per node from --num_gpus if given, else
    SLURM_TASKS_PER_NODE (never SLURM_JOB_CPUS_PER_NODE, which counts CPUs)."""
    from zerorun.launch.hosts import Host

    if not slurm.nodes:
        raise LaunchError("inside a Slurm allocation, but SLURM_JOB_NODELIST is not set: cannot tell its nodes.")
    counts = slurm.tasks_per_node if slurm.tasks_per_node and len(slurm.tasks_per_node) == len(slurm.nodes) else None
    hosts = []
    for i, name in enumerate(slurm.nodes):
        if num_gpus is not None:
            slots = -(-num_gpus // k)
        elif counts is not None:
            slots = counts[i]
        else:
            slots = 1
        hosts.append(Host(name, tuple(range(slots)), origin=f"Slurm job {slurm.job_id}"))
    return hosts
