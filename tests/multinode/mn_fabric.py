"""Fake hosts for multi-node tests: network namespaces on a private bridge, each with its own sshd,
host name (`nodeI`, a UTS namespace) and /etc/hosts naming every node (a mount namespace).

Everything lives on a private test subnet (10.77.K.0/24) that exists only inside this machine:
no default route, nothing leaves it. Names carry a per-run id; a state file per run
(/tmp/zerorun-multinode/RUNID.json, with the owning pid) lets the next run remove leftovers of
a run that died without cleaning up, while never touching a run that is still alive.

Set-up failures raise (the tests fail loudly, they never skip): CI runs as root with
openssh-server and iproute2 installed by scripts/bootstrap.sh --system.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

STATE_DIR = Path("/tmp/zerorun-multinode")
SSHD = "/usr/sbin/sshd"
PREFIX = "zrmn"  # namespaces zrmn-RUNID-N; links zrbRUNID, zrhRUNIDN, zrvRUNIDN


def sh(*argv: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


@dataclass
class Node:
    index: int
    netns: str
    addr: str
    ifname: str  # the namespace's interface (GLOO_SOCKET_IFNAME)
    host_if: str  # its peer on the bridge, in the root namespace
    alias: str  # ssh alias in the test's ~/.ssh/config
    host_key_pub: str
    sshd: subprocess.Popen[bytes] | None = None
    # The processes of an idle node (unshare + the sshd listener), recorded at start.
    baseline: set[int] = field(default_factory=set)

    def pids(self) -> set[int]:
        """Live (non-zombie) processes in this namespace."""
        out = sh("ip", "netns", "pids", self.netns, check=False).stdout.split()
        return {int(p) for p in out if _alive(int(p))}

    def job_pids(self) -> set[int]:
        """Processes of a job in this namespace: everything but sshd itself (its listener and
        the per-connection processes it keeps until a dead TCP connection times out)."""
        return {p for p in self.pids() - self.baseline if _comm(p) != "sshd"}


@dataclass
class Fabric:
    run_id: str
    subnet: str  # "10.77.K"
    bridge: str
    dir: Path
    home: Path  # HOME for launchers in tests: .ssh/config, known_hosts, client key
    nodes: list[Node] = field(default_factory=list)

    @property
    def unreachable_addr(self) -> str:
        return f"{self.subnet}.99"  # inside the subnet, never assigned

    def known_hosts_line(self, node: Node) -> str:
        return f"{node.addr} {node.host_key_pub}"

    def link(self, node: Node, up: bool) -> None:
        sh("ip", "link", "set", node.host_if, "up" if up else "down")

    def netns_run(self, node: Node, *argv: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
        return sh("ip", "netns", "exec", node.netns, *argv, timeout=timeout, check=False)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # Field 3 is the state; a zombie ("Z") or dead ("X") process is gone for our purposes.
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _die_with_parent() -> None:
    """In the forked child: SIGKILL when the test process dies, so a killed pytest takes its
    sshds (and, through unshare --kill-child, everything in their PID namespaces) along. The
    namespaces and links themselves are removed by the next run's cleanup_stale()."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _used_subnets() -> set[str]:
    out = sh("ip", "-4", "-o", "addr", "show").stdout
    return {line.split()[3].rsplit(".", 1)[0] for line in out.splitlines() if " inet " in line}


def cleanup_stale() -> None:
    """Remove namespaces, links and sshds of earlier runs whose owner is gone."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    live_ids: set[str] = set()
    for state_file in STATE_DIR.glob("*.json"):
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):
            state_file.unlink(missing_ok=True)
            continue
        if _alive(int(state["owner"])):
            live_ids.add(state["run_id"])
            continue
        _teardown(state)
        state_file.unlink(missing_ok=True)
    # Namespaces or links with our prefix and no live owner (a run killed before writing state).
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(f"{PREFIX}-") and name.split("-")[1] not in live_ids:
            _kill_netns_pids(name)
            sh("ip", "netns", "del", name, check=False)
    for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        ifname = line.split(":")[1].strip().split("@")[0]
        if ifname.startswith(("zrb", "zrh")) and ifname[3:8] not in live_ids:
            sh("ip", "link", "del", ifname, check=False)


def _kill_netns_pids(netns: str) -> None:
    for pid in sh("ip", "netns", "pids", netns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def _teardown(state: dict) -> None:
    for pid in state.get("sshd_pids", []):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for netns in state.get("netns", []):
        _kill_netns_pids(netns)
        sh("ip", "netns", "del", netns, check=False)
    if state.get("bridge"):
        sh("ip", "link", "del", state["bridge"], check=False)
    if state.get("dir"):
        shutil.rmtree(state["dir"], ignore_errors=True)


def _save(fabric: Fabric) -> None:
    state = {
        "owner": os.getpid(),
        "run_id": fabric.run_id,
        "bridge": fabric.bridge,
        "netns": [n.netns for n in fabric.nodes],
        "sshd_pids": [n.sshd.pid for n in fabric.nodes if n.sshd],
        "dir": str(fabric.dir),
    }
    (STATE_DIR / f"{fabric.run_id}.json").write_text(json.dumps(state))


def create(num_nodes: int = 3) -> Fabric:
    """Bridge + `num_nodes` namespaces with sshd; a HOME with ssh config, client key and a
    known_hosts file holding the host keys of every node but the last (for the unknown-key
    test). Raises on any failure, after tearing down what it built."""
    if os.geteuid() != 0:
        raise RuntimeError("multi-node tests need root (network namespaces); CI runs as root")
    for tool in (SSHD, shutil.which("ip"), shutil.which("ssh-keygen")):
        if not tool or not Path(tool).exists():
            raise RuntimeError("multi-node tests need openssh-server and iproute2: run scripts/bootstrap.sh --system")
    cleanup_stale()
    run_id = secrets.token_hex(3)[:5]
    used = _used_subnets()
    free = [k for k in range(10, 250) if f"10.77.{k}" not in used]
    subnet = f"10.77.{random.choice(free)}"
    base = Path(f"/tmp/zerorun-multinode/{run_id}")
    base.mkdir(parents=True)
    home = base / "home"
    (home / ".ssh").mkdir(parents=True)
    fabric = Fabric(run_id, subnet, f"zrb{run_id}", base, home)
    _save(fabric)
    try:
        _build(fabric, num_nodes)
    except BaseException:
        destroy(fabric)
        raise
    return fabric


def _build(fabric: Fabric, num_nodes: int) -> None:
    base, home, rid = fabric.dir, fabric.home, fabric.run_id
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(home / ".ssh" / "id_ed25519"))
    authorized = base / "authorized_keys"
    shutil.copy(home / ".ssh" / "id_ed25519.pub", authorized)
    authorized.chmod(0o600)

    sh("ip", "link", "add", fabric.bridge, "type", "bridge")
    sh("ip", "addr", "add", f"{fabric.subnet}.1/24", "dev", fabric.bridge)
    sh("ip", "link", "set", fabric.bridge, "up")
    ssh_config: list[str] = []
    hosts = base / "hosts"  # every fake host's /etc/hosts (see below)
    hosts.write_text(
        "127.0.0.1 localhost\n::1 localhost ip6-localhost\n"
        + "".join(f"{fabric.subnet}.{10 + i} node{i}\n" for i in range(1, num_nodes + 1))
    )
    for i in range(1, num_nodes + 1):
        node = Node(
            index=i,
            netns=f"{PREFIX}-{rid}-{i}",
            addr=f"{fabric.subnet}.{10 + i}",
            ifname=f"zrv{rid}{i}",
            host_if=f"zrh{rid}{i}",
            alias=f"node{i}",
            host_key_pub="",
        )
        fabric.nodes.append(node)
        _save(fabric)
        sh("ip", "netns", "add", node.netns)
        sh("ip", "link", "add", node.host_if, "type", "veth", "peer", "name", node.ifname)
        sh("ip", "link", "set", node.ifname, "netns", node.netns)
        sh("ip", "link", "set", node.host_if, "master", fabric.bridge)
        sh("ip", "link", "set", node.host_if, "up")
        for cmd in (
            ("ip", "link", "set", "lo", "up"),
            ("ip", "addr", "add", f"{node.addr}/24", "dev", node.ifname),
            ("ip", "link", "set", node.ifname, "up"),
        ):
            sh("ip", "netns", "exec", node.netns, *cmd)
        key = base / f"host_key_{i}"
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
        node.host_key_pub = " ".join((base / f"host_key_{i}.pub").read_text().split()[:2])
        cfg = base / f"sshd_config_{i}"
        cfg.write_text(
            "\n".join(
                [
                    f"ListenAddress {node.addr}",
                    "ListenAddress 127.0.0.1",  # the node's own loopback (ProxyJump test)
                    "Port 22",
                    "Port 2222",  # a non-default port (ssh config Port, `[host]:port` known_hosts)
                    f"HostKey {key}",
                    f"AuthorizedKeysFile {authorized}",
                    f"PidFile {base}/sshd_{i}.pid",
                    "StrictModes no",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "MaxStartups 100",
                    "MaxSessions 50",
                    "LogLevel ERROR",
                    "",
                ]
            )
        )
        log = open(base / f"sshd_{i}.log", "wb")  # noqa: SIM115 - lives as long as sshd
        # Each fake host also gets its own PID namespace (and /proc): what a node's agent sees
        # and kills is that node's processes only, as on a real cluster. sshd is its PID 1,
        # so killing it (or unshare, via --kill-child) takes the whole fake host down. And its
        # own host name (UTS namespace: `nodeI`, what socket.gethostname() says there) with an
        # /etc/hosts bind-mounted in its own mount namespace that resolves every node's name to
        # its address, so host-name-based logic (rank 0's host as the master) really runs.
        init = f"hostname {node.alias} && mount --bind {hosts} /etc/hosts && exec {SSHD} -D -e -f {cfg}"
        node.sshd = subprocess.Popen(
            [
                "ip", "netns", "exec", node.netns,
                "unshare", "--uts", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child",
                "sh", "-c", init,
            ],  # fmt: skip
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        _save(fabric)
        ssh_config += [
            f"Host {node.alias}",
            f"    HostName {node.addr}",
            "    User root",
            f"    IdentityFile {home / '.ssh' / 'id_ed25519'}",
            "    ConnectTimeout 3",
            "",
        ]
    ssh_config += [
        "Host unreachable",
        f"    HostName {fabric.unreachable_addr}",
        "    User root",
        "    ConnectTimeout 2",
        "",
    ]
    (home / ".ssh" / "config").write_text("\n".join(ssh_config))
    # Every node's key but the last one's: that node is "a host whose key is unknown".
    (home / ".ssh" / "known_hosts").write_text(
        "".join(fabric.known_hosts_line(n) + "\n" for n in fabric.nodes[:-1])
    )
    deadline = time.monotonic() + 15
    for node in fabric.nodes:
        while True:
            if node.sshd is not None and node.sshd.poll() is not None:
                log_text = (base / f"sshd_{node.index}.log").read_text()
                raise RuntimeError(f"sshd in {node.netns} exited: {log_text}")
            with contextlib.suppress(OSError), socket.create_connection((node.addr, 22), timeout=1):
                node.baseline = node.pids()
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd in {node.netns} does not accept connections on {node.addr}:22")
            time.sleep(0.1)


def add_names(fabric: Fabric, names: dict[str, list[str]]) -> None:
    """More names for fake hosts (address -> names), as a cluster's DNS would give them (a
    Kubernetes pod's `job-0.service`): appended to the hosts file every node has bind-mounted as
    its /etc/hosts (in place, so the mounts see it)."""
    with open(fabric.dir / "hosts", "a") as fh:
        fh.writelines(f"{addr} {' '.join(aliases)}\n" for addr, aliases in names.items())


def destroy(fabric: Fabric) -> None:
    for node in fabric.nodes:
        if node.sshd is not None and node.sshd.poll() is None:
            node.sshd.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.sshd.wait(timeout=5)
    _teardown(
        {
            "netns": [n.netns for n in fabric.nodes],
            "bridge": fabric.bridge,
            "dir": str(fabric.dir),
        }
    )
    (STATE_DIR / f"{fabric.run_id}.json").unlink(missing_ok=True)
