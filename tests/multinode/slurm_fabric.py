"""A real Slurm cluster on the fake hosts of mn_fabric: slurmctld in the root network namespace,
one slurmd per fake host, one munged for all.

Recipe (../shared/notes/test-machine-facts.md): slurmctld under `unshare --uts` with the
hostname of SlurmctldHost; each slurmd entered with `nsenter --net=/run/netns/X` (not `ip netns
exec`, which hides /sys/fs/cgroup) in its own UTS + mount + PID namespace, with an /etc/hosts
bind-mounted there so the node names resolve inside the nodes; a small shell as the PID
namespace's init reaps slurmstepd's children and forwards SIGTERM. Clients need only
SLURM_CONF. Nothing under /etc is written; everything lives in the fabric's directory and dies
with it (daemons are killed in `stop`, which the fixture's finalizer calls).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import mn_fabric as fabric

DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")


@dataclass
class Slurm:
    fab: fabric.Fabric
    dir: Path
    conf: Path
    nodes: list[fabric.Node]
    names: list[str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(self, base: dict[str, str]) -> dict[str, str]:
        return {**base, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self.env(dict(os.environ)))

    def idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout.split("\n")
        states = dict(line.split() for line in out if line.strip())
        return all(states.get(n) == "idle" for n in self.names)

    def log_tail(self) -> str:
        parts = []
        for log in sorted(self.dir.glob("*.log")):
            parts.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(parts)


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start(fab: fabric.Fabric, nodes: list[fabric.Node]) -> Slurm:
    """Daemons up and every node idle, or RuntimeError (after stopping what started)."""
    for d in DAEMONS:
        if not Path(d).exists():
            raise RuntimeError(f"{d} missing: Slurm tests need scripts/bootstrap.sh --system (slurmctld, slurmd, munge)")
    base = fab.dir / "slurm"
    for sub in ("ctld", "spool", "tmp", "munge"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    (base / "munge").chmod(0o755)
    key = base / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    ctl_port = random.randint(20000, 29000)
    names = [n.alias for n in nodes]
    hosts = base / "hosts"
    hosts.write_text(
        "127.0.0.1 localhost\n"
        + f"{fab.subnet}.1 zrctl\n"
        + "".join(f"{n.addr} {n.alias}\n" for n in nodes)
    )
    conf = base / "slurm.conf"
    cpus = 8
    conf.write_text(
        "\n".join(
            [
                "ClusterName=zerorun",
                f"SlurmctldHost=zrctl({fab.subnet}.1)",
                f"SlurmctldPort={ctl_port}",
                f"SlurmdPort={ctl_port + 1}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={base}/munge/munge.sock",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"StateSaveLocation={base}/ctld",
                f"SlurmdSpoolDir={base}/spool/%n",
                f"TmpFS={base}/tmp/%n",
                f"SlurmctldPidFile={base}/slurmctld.pid",
                f"SlurmdPidFile={base}/slurmd-%n.pid",
                f"SlurmctldLogFile={base}/slurmctld.log",
                f"SlurmdLogFile={base}/slurmd-%n.log",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "MpiDefault=none",
                "SlurmdParameters=config_overrides",
                "ReturnToService=2",
                "JobCompType=jobcomp/none",
                "AccountingStorageType=accounting_storage/none",
                "SchedulerType=sched/builtin",
                "KillWait=2",
                "MessageTimeout=5",
                "InactiveLimit=0",
                *(f"NodeName={n.alias} NodeAddr={n.addr} CPUs={cpus} State=UNKNOWN" for n in nodes),
                f"PartitionName=zr Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
                "",
            ]
        )
    )
    slurm = Slurm(fab, base, conf, nodes, names)
    env = slurm.env(dict(os.environ))
    try:
        def spawn(argv: list[str], log: str) -> subprocess.Popen[bytes]:
            out = open(base / log, "ab")  # noqa: SIM115 - lives as long as the daemon
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, preexec_fn=_die_with_parent)
            slurm.procs.append(proc)
            return proc

        spawn(
            ["/usr/sbin/munged", "-F", "-f", f"--socket={base}/munge/munge.sock", f"--key-file={key}",
             f"--pid-file={base}/munged.pid", f"--log-file={base}/munged.log", f"--seed-file={base}/munged.seed"],
            "munged.out.log",
        )
        _wait(lambda: (base / "munge" / "munge.sock").exists(), 10, "munged did not create its socket", slurm)
        spawn(
            ["unshare", "--uts", "--kill-child", "sh", "-c",
             f"hostname zrctl && exec /usr/sbin/slurmctld -D -i -f {conf}"],
            "slurmctld.out.log",
        )
        for n in nodes:
            (base / "spool" / n.alias).mkdir(parents=True, exist_ok=True)
            (base / "tmp" / n.alias).mkdir(parents=True, exist_ok=True)
            init = (
                f"hostname {n.alias} && mount --bind {hosts} /etc/hosts && "
                f"/usr/sbin/slurmd -D -N {n.alias} -f {conf} & pid=$!; "
                "trap 'kill -TERM $pid' TERM; while kill -0 $pid 2>/dev/null; do wait; done"
            )
            spawn(
                ["nsenter", f"--net=/run/netns/{n.netns}", "unshare", "--uts", "--mount", "--pid", "--fork",
                 "--mount-proc", "--kill-child", "sh", "-c", init],
                f"slurmd-{n.alias}.out.log",
            )
        _wait(slurm.idle, 30, "the Slurm nodes never became idle", slurm)
    except BaseException:
        stop(slurm)
        raise
    return slurm


def _wait(pred, timeout: float, what: str, slurm: Slurm) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            if pred():
                return
        dead = [p.args for p in slurm.procs if p.poll() is not None]
        if time.monotonic() > deadline or dead:
            raise RuntimeError(f"{what} (exited: {dead})\n{slurm.log_tail()}")
        time.sleep(0.1)


def stop(slurm: Slurm) -> None:
    with contextlib.suppress(Exception):
        slurm.run("scancel", "--full", "-u", "root", timeout=5)
    for proc in reversed(slurm.procs):
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + 6
    for proc in slurm.procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    shutil.rmtree(slurm.dir / "spool", ignore_errors=True)
