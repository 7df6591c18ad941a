"""Node agents that dial in: a scheduler's launcher command (srun, mpirun) starts `python -m
zerorun.launch.agent --dial` on every node, and each agent connects back to this launcher over
TCP, then speaks `launch/wire.py` exactly as an SSH agent does (preflight, plan, rank messages,
heartbeats). Used by `launch/slurm.py` and `launch/mpi.py`.

- The launcher listens on a free port; `ZERORUN_AGENT_DIAL` (`HOST[,HOST...]:PORT`, this
  machine's addresses) and `ZERORUN_AGENT_TOKEN` (a per-job secret) reach the agents through
  the scheduler's environment, never a command line. An agent's first message is `dial` {token,
  node, hostname, pid}; `node` names which node it is (the Slurm node name, or the MPI rank).
- The preflight is the SSH one: same zerorun version and protocol, the script exists, the GPUs
  cover the slots (`remote.check_devices`), the master port free (or picked) on node 0; the
  master address is node 0's address on its connection to the launcher.
- Runners are `agent_runner.AgentRunner`s (as over SSH); the last one closed ends the scheduler's
  command (SIGTERM to its process group, SIGKILL after 5 s): with no task left, the scheduler
  kills what it started.
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from zerorun.errors import LaunchError
from zerorun.launch import tcp_link, wire
from zerorun.launch.agent_runner import AgentRunner
from zerorun.launch.knobs import env_number
from zerorun.launch.link import Link, LinkHub

__all__ = ["local_addresses", "DialSetup", "DialedStep", "DialedRunner", "prepare_dialed", "START_TIMEOUT_S"]

# How long the agents get to dial in after the command started (node start-up, a busy scheduler).
START_TIMEOUT_S = 60.0
# How long a connection gets to send its `dial` message before it is dropped.
_HELLO_WAIT_S = 10.0


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


def _token_matches(given: object, token: str) -> bool:
    """Whether a dialing agent knows the job's secret; in constant time (anyone on the network
    can connect to the port and time the comparison)."""
    return isinstance(given, str) and secrets.compare_digest(given.encode(), token.encode())


class DialedStep:
    """The scheduler's command (srun, mpirun): its output tail, and SIGTERM once every runner
    closed."""

    def __init__(self, argv: list[str], env: Mapping[str, str], cwd: str) -> None:
        self.argv = argv
        self.what = os.path.basename(argv[0])
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
            raise LaunchError(f"{argv[0]} is not installed here (or not on PATH).") from None
        self.tail: list[str] = []
        self._open = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name=f"zerorun-{self.what}-output", daemon=True).start()

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
        return f"{self.what} exited with status {code}" + (f":\n{tail}" if tail else "")

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


class DialedRunner(AgentRunner):
    """`AgentRunner` whose last `close()` also ends the scheduler's command."""

    def __init__(self, *args: Any, step: DialedStep, owns_hub: LinkHub | None, **kwargs: Any) -> None:
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


@dataclass(frozen=True)
class DialSetup:
    """What a scheduler's command is built from (`launch/slurm.py`, `launch/mpi.py`)."""

    names: tuple[str, ...]  # the nodes' host names, in the plan's order
    python: str  # the interpreter on the nodes (--remote_python, else this one)
    cwd: str  # the working directory on the nodes (--remote_cwd, else the plan's)
    # The command's environment, which srun/mpirun hand to the agents and the agents' ranks
    # inherit under each node's `node.env`: the launcher's, less `withheld` (secret-looking
    # variables nobody named, `environment.EnvSpec.withheld`), as over SSH. The dial
    # variables are added to it when the command starts.
    env: Mapping[str, str]


def prepare_dialed(
    plan: Any,
    options: Any,
    *,
    command: Callable[[DialSetup], list[str]],
    node_of: Callable[[str, Sequence[str]], str | None],
    withheld: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    ranks_from_gpus: bool = False,
) -> tuple[Any, list[Any]]:
    """Run `command(setup)` (argv) with the setup's environment plus the dial variables, wait
    for every node's agent, run the preflight, return the plan with the master the ranks will
    use and one runner per node. `node_of(dial_node, names)` maps an agent's `node` to its host
    name in the plan (None: not one of ours). Without `--device`, the device is each node's own
    (`launch/node_devices.py`; `ranks_from_gpus`: a GPU node runs a rank per GPU). Nothing
    starts before every node passed; a failure stops the command and raises LaunchError naming
    the nodes."""
    from zerorun.launch.fanout import failure_table
    from zerorun.launch.node_devices import adopt_node_devices
    from zerorun.launch.remote import check_devices, ssh_options_from

    skip = set(withheld)
    setup = DialSetup(
        names=tuple(n.host.name for n in plan.nodes),
        python=options.remote_python or sys.executable,
        cwd=options.remote_cwd or plan.cwd,
        env={k: v for k, v in (os.environ if environ is None else environ).items() if k not in skip},
    )
    names, python, cwd, env = list(setup.names), setup.python, setup.cwd, setup.env
    argv = command(setup)
    listener = tcp_link.listen(0)
    port = listener.getsockname()[1]
    token = secrets.token_hex(16)
    addresses = [a for a in [env.get("ZERORUN_LAUNCHER_ADDR", ""), *local_addresses()] if a]
    target = f"{','.join(addresses)}:{port}"
    hub = LinkHub()
    step = DialedStep(argv, {**env, "ZERORUN_AGENT_DIAL": target, "ZERORUN_AGENT_TOKEN": token}, cwd)
    links: dict[str, Link] = {}
    # Connections accepted but not yet judged, with when they came: a stranger that says
    # nothing (a port scanner) must not hold up the agents behind it.
    pending: list[tuple[Link, float]] = []
    try:
        timeout = env_number(
            ("ZERORUN_AGENT_START_TIMEOUT", "ZERORUN_SLURM_START_TIMEOUT"), START_TIMEOUT_S, minimum=1.0, environ=env
        )
        assert timeout is not None
        deadline = time.monotonic() + timeout
        while len(links) < len(names):
            if step.proc.poll() is not None:
                raise LaunchError(
                    f"the node agents did not start ({len(links)} of {len(names)} dialed in): {step.describe_exit()}"
                )
            now = time.monotonic()
            for entry in list(pending):
                link, since = entry
                try:
                    hello = link.messages.get_nowait()
                except queue.Empty:
                    if now - since > _HELLO_WAIT_S:
                        pending.remove(entry)
                        link.close()
                    continue
                pending.remove(entry)
                name = node_of(str(hello.get("node")), setup.names) if hello and hello.get("t") == "dial" else None
                if hello is None or not _token_matches(hello.get("token"), token) or name not in names or name in links:
                    link.close()  # not one of ours (or a duplicate): ignore
                    continue
                assert name is not None
                link.name = link.display = name
                links[name] = link
            if len(links) == len(names):
                break
            if now >= deadline:
                missing = [n for n in names if n not in links]
                raise LaunchError(
                    f"the node agents of {', '.join(missing)} did not dial in to this launcher within "
                    f"{timeout:g} s (port {port} on {', '.join(addresses)}); a firewall between the nodes and "
                    "this machine? Set ZERORUN_LAUNCHER_ADDR to an address they can reach."
                )
            link = tcp_link.accept(listener, hub, min(deadline, now + (0.05 if pending else 0.5)), name="agent")
            if link is not None:
                pending.append((link, time.monotonic()))
        for link, _ in pending:
            link.close()
        pending.clear()
        listener.close()

        for i, name in enumerate(names):
            links[name].send(
                "preflight",
                **wire.preflight_fields(
                    check_port=options.master_port if i == 0 else None,
                    pick_port=i == 0 and options.master_port is None,
                    script=plan.target.script,
                ),
            )
        def silent(name: str) -> tuple[str, str]:
            tail = "; ".join(links[name].stderr_tail[-3:] or step.tail[-3:])
            return "timeout", "the node agent did not answer the preflight" + (f" ({tail})" if tail else "")

        hellos, errors = wire.collect_hellos({n: links[n] for n in names}, time.monotonic() + 30, python=python, silent=silent)
        if errors:
            raise LaunchError(failure_table(errors, what="The preflight") + "\nNothing was started.")
        master = hellos[names[0]]
        auto = getattr(options, "device", None) in (None, "auto")
        if auto:
            plan = adopt_node_devices(
                plan, {h: int(v.get("gpus") or 0) for h, v in hellos.items()}, ranks_from_gpus=ranks_from_gpus
            )
        check_devices(plan, hellos, auto=auto)
        addr = options.master_addr or master.get("server_addr") or names[0]
        plan = replace(plan.with_master(addr, int(master["port"])), cwd=cwd)
        ssh = ssh_options_from(options)
        runners: list[Any] = [
            DialedRunner(
                plan,
                node,
                links[node.host.name],
                heartbeat_s=ssh.heartbeat_s,
                heartbeat_timeout_s=ssh.heartbeat_timeout_s,
                step=step,
                owns_hub=hub if i == len(plan.nodes) - 1 else None,
            )
            for i, node in enumerate(plan.nodes)
        ]
        return plan, runners
    except BaseException:
        listener.close()
        for link in [*links.values(), *(p[0] for p in pending)]:
            link.close()
        step.stop(grace=2.0)
        hub.close()
        raise
