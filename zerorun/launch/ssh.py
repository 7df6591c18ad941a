"""SSH to the nodes of a job: connections, host-key checks, ~/.ssh/config, the agent channel.

paramiko is imported lazily, inside the functions that connect: one-node runs and machines
without paramiko never load it.

One connection per node, opened in parallel. On each, one exec channel runs the node agent
(`python -m zerorun.launch.agent`, see `launch/agent.py`, protocol in `launch/wire.py`); the
same channel carries the preflight, the plan, the ranks' output and events, and heartbeats
(`launch/remote.py` runs the preflight over it, then `launch/agent_runner.AgentRunner` drives it;
this module never imports remote.py).
The remote command is built from `shlex.quote`d pieces only (remote cwd, interpreter path):
a hostile host name or argument never reaches a shell unquoted, and everything else travels
as JSON on stdin.

Security: host keys are checked against the system and user known_hosts files (and
`UserKnownHostsFile` from ~/.ssh/config). An unknown key is an error unless
`accept_new_hosts` (trust on first use, like OpenSSH's `StrictHostKeyChecking accept-new`,
the key is then saved to ~/.ssh/known_hosts); a changed key is always an error.
"""

from __future__ import annotations

import os
import shlex
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerorun.errors import LaunchError
from zerorun.launch import fdlimit, wire
from zerorun.launch.agent_runner import AgentInbox
from zerorun.launch.fanout import DEFAULT_PARALLELISM, NodeFailure, failure_table, fan_out

if TYPE_CHECKING:  # pragma: no cover
    import paramiko

__all__ = [
    "SshOptions",
    "SshTarget",
    "NodeChannel",
    "resolve_target",
    "connect_nodes",
    "close_client",
    "agent_command",
]

DEFAULT_CONNECT_TIMEOUT_S = 10.0
_known_hosts_lock = threading.Lock()


@dataclass(frozen=True)
class SshOptions:
    """How to reach the nodes and run the agent there; built by the CLI from its options."""

    remote_python: str | None = None  # default: the launcher's sys.executable
    remote_cwd: str | None = None  # default: the launcher's cwd
    accept_new_hosts: bool = False
    connect_timeout: float | None = None  # default: ConnectTimeout from ~/.ssh/config, else 10 s
    port: int | None = None  # every node's SSH port, over ~/.ssh/config's Port (--ssh-port; DeepSpeed's --ssh_port)
    heartbeat_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    ssh_config: str | None = None  # default: ~/.ssh/config
    preflight_timeout_s: float = 30.0
    parallelism: int = DEFAULT_PARALLELISM  # connections being opened at once (pdsh's fan-out)
    connect_retries: int = 2  # more attempts after a transient failure (refused, timeout, throttled)
    retry_backoff_s: float = 1.0  # before the first retry; doubled each time, +-50% jitter


@dataclass(frozen=True)
class SshTarget:
    """Where an ssh alias really points, after ~/.ssh/config."""

    alias: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    connect_timeout: float
    proxy_command: str | None = None
    known_hosts_files: tuple[str, ...] = ()
    proxy_jump: tuple[str, ...] = ()  # hops, "[user@]host[:port]", first hop first

    @property
    def display(self) -> str:
        where = self.hostname if self.port == 22 else f"{self.hostname}:{self.port}"
        return self.alias if where == self.alias else f"{self.alias} ({where})"

    @property
    def known_hosts_name(self) -> str:
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"


def resolve_target(alias: str, options: SshOptions) -> SshTarget:
    """Apply ~/.ssh/config (HostName, Port, User, IdentityFile, ConnectTimeout, ProxyCommand,
    ProxyJump, UserKnownHostsFile) the way `ssh ALIAS` would."""
    import paramiko

    path = Path(options.ssh_config or "~/.ssh/config").expanduser()
    cfg: dict[str, Any] = {}
    if path.is_file():
        try:
            cfg = dict(paramiko.SSHConfig.from_path(str(path)).lookup(alias))
        except Exception as err:  # paramiko raises several types for a bad file
            raise LaunchError(f"cannot read ssh config {path}: {err}") from err
    try:
        port = options.port or int(cfg.get("port", 22))
    except ValueError:
        raise LaunchError(f"{path}: Port {cfg.get('port')!r} for host {alias} is not a number.") from None
    timeout = options.connect_timeout
    if timeout is None:
        timeout = float(cfg["connecttimeout"]) if "connecttimeout" in cfg else DEFAULT_CONNECT_TIMEOUT_S
    jump = cfg.get("proxyjump", "")
    hops = () if jump.lower() in ("", "none") else tuple(h.strip() for h in jump.split(",") if h.strip())
    user_known = cfg.get("userknownhostsfile")
    known = tuple(os.path.expanduser(p) for p in user_known.split()) if user_known else ()
    return SshTarget(
        alias=alias,
        hostname=cfg.get("hostname", alias),
        port=port,
        user=cfg.get("user") or _local_user(),
        identity_files=tuple(os.path.expanduser(p) for p in cfg.get("identityfile", [])),
        connect_timeout=timeout,
        proxy_command=cfg.get("proxycommand"),
        known_hosts_files=known,
        proxy_jump=hops,
    )


def _local_user() -> str:
    import getpass

    return getpass.getuser()


def _client_for(target: SshTarget, options: SshOptions) -> paramiko.SSHClient:
    import paramiko

    client = paramiko.SSHClient()
    client.load_system_host_keys()  # ~/.ssh/known_hosts
    # More files go into the client's own set; paramiko checks both sets and, with our
    # policies, never writes either back.
    extra = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2", *target.known_hosts_files)
    for path in extra:
        if os.path.isfile(path):
            try:
                client.get_host_keys().load(path)
            except OSError as err:
                raise LaunchError(f"cannot read known_hosts file {path}: {err}") from err
    client.set_missing_host_key_policy(_AcceptNewPolicy() if options.accept_new_hosts else _RejectPolicy(target))
    return client


class _RejectPolicy:
    """Unknown host key -> a LaunchError that says how to accept it."""

    def __init__(self, target: SshTarget) -> None:
        self.target = target

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        t = self.target
        port_opt = "" if t.port == 22 else f"-p {t.port} "
        raise LaunchError(
            f"host key of {t.display} is not in known_hosts ({key.get_name()} "
            f"{key.fingerprint if hasattr(key, 'fingerprint') else ''}). Check the key with the "
            f"node's administrator, then add it: `ssh-keyscan {port_opt}{t.hostname} >> ~/.ssh/known_hosts` "
            f"(or connect once with `ssh {t.alias}`), or pass --ssh-accept-new-hosts to trust "
            "new hosts on first use."
        )


class _AcceptNewPolicy:
    """Trust on first use: remember the key in ~/.ssh/known_hosts (a changed key still fails,
    paramiko raises BadHostKeyException before consulting a policy)."""

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        path = Path("~/.ssh/known_hosts").expanduser()
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        with _known_hosts_lock:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "a") as fh:
                fh.write(line)


def _connect_one(alias: str, options: SshOptions) -> tuple[SshTarget, paramiko.SSHClient]:
    """Connect to one node, through its ProxyJump hops (each verified like a node) or its
    ProxyCommand when ~/.ssh/config has one."""
    import paramiko

    _quiet_paramiko()
    target = resolve_target(alias, options)
    jumps: list[paramiko.SSHClient] = []
    try:
        sock: Any = None
        if target.proxy_jump:
            route = [_hop_target(h, options) for h in target.proxy_jump] + [target]
            for hop, nxt in zip(route, route[1:]):  # noqa: B905 - route[1:] is one shorter
                hop_client = _open(hop, options, sock)
                jumps.append(hop_client)
                sock = _tunnel(hop_client, hop, nxt)
        elif target.proxy_command:
            sock = paramiko.ProxyCommand(target.proxy_command)
        client = _open(target, options, sock)
    except BaseException:
        for j in reversed(jumps):
            j.close()
        raise
    client._zerorun_jumps = jumps  # type: ignore[attr-defined]  # closed with the client
    return target, client


def _quiet_paramiko() -> None:
    """paramiko logs failures (e.g. "Secsh channel 0 open FAILED") that we report ourselves,
    better worded; without a handler Python would print them to stderr."""
    import logging

    logger = logging.getLogger("paramiko")
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())


def _hop_target(hop: str, options: SshOptions) -> SshTarget:
    """`[user@]host[:port]` of a ProxyJump; host may itself be an alias of ~/.ssh/config."""
    from dataclasses import replace

    user, _, rest = hop.rpartition("@")
    host, colon, port = rest.partition(":")
    t = resolve_target(host, options)
    if colon:
        try:
            t = replace(t, port=int(port))
        except ValueError:
            raise LaunchError(f"ProxyJump {hop!r} in ssh config: {port!r} is not a port number.") from None
    return replace(t, user=user) if user else t


def _tunnel(via: paramiko.SSHClient, hop: SshTarget, to: SshTarget) -> Any:
    import paramiko

    transport = via.get_transport()
    try:
        assert transport is not None
        return transport.open_channel("direct-tcpip", (to.hostname, to.port), ("127.0.0.1", 0),
                                      timeout=to.connect_timeout)
    except (paramiko.SSHException, OSError, AssertionError) as err:
        raise LaunchError(
            f"the jump host {hop.display} cannot reach {to.display}: {err or 'connection refused'}. "
            "Check ProxyJump and HostName in ~/.ssh/config."
        ) from None


def close_client(client: paramiko.SSHClient) -> None:
    """Close a node's connection and the jump hosts it went through."""
    client.close()
    for j in reversed(getattr(client, "_zerorun_jumps", [])):
        j.close()


def _open(target: SshTarget, options: SshOptions, sock: Any) -> paramiko.SSHClient:
    import paramiko

    client = _client_for(target, options)
    try:
        client.connect(
            target.hostname,
            port=target.port,
            username=target.user,
            key_filename=list(target.identity_files) or None,
            timeout=target.connect_timeout,
            banner_timeout=target.connect_timeout,
            auth_timeout=target.connect_timeout,
            sock=sock,
        )
    except NodeFailure:
        client.close()
        raise
    except LaunchError as err:  # the missing-host-key policy
        client.close()
        raise NodeFailure("host key", str(err)) from None
    except paramiko.BadHostKeyException as err:
        client.close()
        raise NodeFailure(
            "host key",
            f"host key of {target.display} has CHANGED since it was recorded in known_hosts: "
            "this can be a man-in-the-middle attack, or the node was reinstalled. After checking "
            f"with its administrator, remove the old key (`ssh-keygen -R '{target.known_hosts_name}'`) "
            f"and add the new one. Expected {err.expected_key.get_name()}, got {err.key.get_name()}."
        ) from None
    except paramiko.AuthenticationException as err:
        client.close()
        raise NodeFailure(
            "auth",
            f"cannot log in to {target.display} as {target.user}: {err}. zerorun uses your ssh "
            "keys and agent (no passwords): check that `ssh -o BatchMode=yes "
            f"{target.alias} true` works, and User/IdentityFile in ~/.ssh/config."
        ) from None
    except TimeoutError:
        client.close()
        raise NodeFailure(
            "timeout",
            f"cannot reach {target.display}: no answer within {target.connect_timeout:g} s. "
            "Check the name/address in the hostfile and that sshd runs there.",
        ) from None  # not retried: the per-node timeout already bounds how long a node may take
    except OSError as err:  # refused, no route, unknown name (paramiko's NoValidConnectionsError too)
        client.close()
        import socket

        raise NodeFailure(
            "unknown host" if isinstance(err, socket.gaierror) else "unreachable",
            f"cannot reach {target.display}: {err.strerror or err}. Check the name/address in the "
            "hostfile (or HostName/Port in ~/.ssh/config) and that sshd runs there.",
            transient=not isinstance(err, socket.gaierror),
        ) from None
    except paramiko.SSHException as err:
        # e.g. "Error reading SSH protocol banner": sshd drops new connections beyond its
        # MaxStartups (default 10:30:100) while many are being authenticated: worth a retry.
        client.close()
        raise NodeFailure("ssh", f"cannot connect to {target.display}: {err}", transient=True) from None
    return client


def connect_nodes(
    aliases: Sequence[str], options: SshOptions
) -> dict[str, tuple[SshTarget, paramiko.SSHClient]]:
    """Connect to every node, `options.parallelism` at a time; a transient failure (refused,
    timed out, sshd throttling) is retried with backoff -- only here, before the agent's
    command runs, so a retry never leaves a second agent behind. Any failure closes every
    connection and raises one LaunchError with a table of every node that failed and why
    (`fanout.failure_table`, for one node as for many)."""
    fdlimit.check(2 * len(aliases), f"SSH connections to {len(aliases)} nodes")

    def attempt(alias: str, _attempt: int) -> tuple[SshTarget, paramiko.SSHClient]:
        try:
            return _connect_one(alias, options)
        except NodeFailure:
            raise
        except LaunchError as err:  # ~/.ssh/config problems, a jump host that cannot reach on
            raise NodeFailure("config", str(err)) from None

    results, failures = fan_out(
        aliases,
        attempt,
        parallelism=options.parallelism,
        retries=options.connect_retries,
        backoff_s=options.retry_backoff_s,
    )
    if failures:
        for _, client in results.values():
            close_client(client)
        raise LaunchError(failure_table(failures, what="SSH") + "\nNothing was started.")
    return results


def agent_command(python: str, cwd: str) -> str:
    """The one command line sent to sshd: every piece quoted, the rest goes over stdin."""
    return f"cd -- {shlex.quote(cwd)} && exec {shlex.quote(python)} -u -m zerorun.launch.agent"


class NodeChannel(AgentInbox):
    """The agent's exec channel on one node (an `agent_runner.AgentChannel`): a reader thread
    for its messages (it also runs the runner's handler), one for its stderr, a writer; the
    runner's heartbeat thread (`beat`)."""

    def __init__(self, alias: str, target: SshTarget, client: paramiko.SSHClient, command: str) -> None:
        super().__init__()
        self.alias = alias
        self.target = target
        self.client = client
        transport = client.get_transport()
        if transport is None:  # pragma: no cover - connect() succeeded
            raise LaunchError(f"SSH connection to {target.display} closed")
        self.channel = transport.open_session()
        self.channel.exec_command(command)
        self._send_lock = threading.Lock()
        self.closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name=f"ssh-read-{alias}", daemon=True)
        self._reader.start()
        self._err_reader = threading.Thread(target=self._read_stderr, name=f"ssh-err-{alias}", daemon=True)
        self._err_reader.start()

    def _lines(self, recv: Callable[[int], bytes]) -> Iterator[bytes]:
        buf = b""
        while True:
            try:
                chunk = recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                if buf:
                    yield buf
                return
            buf += chunk
            *lines, buf = buf.split(b"\n")
            yield from lines

    @property
    def display(self) -> str:
        return self.target.display

    @property
    def route(self) -> str:
        return f"the SSH connection to {self.target.display}"

    def _read(self) -> None:
        for line in self._lines(self.channel.recv):
            self.last_heard = time.monotonic()
            self.take_line(line)  # a login banner or a Python error before the agent ran: kept
        self.deliver(None)  # end of stream

    def _read_stderr(self) -> None:
        for line in self._lines(self.channel.recv_stderr):
            text = line.decode("utf-8", "replace").rstrip()
            if text:
                self.keep_stderr(text)

    def beat(self, tick: Callable[[float], None], every: float) -> None:
        """`tick(now)` every `every` seconds on a thread of this node's own, until closed."""

        def loop() -> None:
            while not self.closed.wait(every):
                tick(time.monotonic())

        threading.Thread(target=loop, name=f"ssh-hb-{self.alias}", daemon=True).start()

    def silent_for(self, now: float) -> float:
        return now - self.last_heard

    def send(self, kind: str, **fields: Any) -> bool:
        """False when the channel is gone (the caller reports the node)."""
        data = wire.encode(kind, **fields)
        with self._send_lock:
            if self.closed.is_set():
                return False
            try:
                self.channel.sendall(data)
                return True
            except (OSError, EOFError):
                return False
            except Exception:  # noqa: BLE001 - paramiko raises SSHException on a dead transport
                return False

    def exit_status(self, timeout: float = 2.0) -> int | None:
        if self.channel.exit_status_ready() or self._wait_exit(timeout):
            return self.channel.recv_exit_status()
        return None

    def _wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.channel.exit_status_ready():
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        """Close stdin (the agent kills its ranks on EOF), then the connection."""
        with self._send_lock:
            if self.closed.is_set():
                return
            self.closed.set()
        try:
            self.channel.shutdown_write()
        except Exception:  # noqa: BLE001, S110 - already gone
            pass
        close_client(self.client)
