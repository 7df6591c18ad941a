"""A private sshd on 127.0.0.1 for `launcher_scale ssh` (root; OpenSSH's sshd installed).

`loopback_sshd(n)` yields (ssh config path, HOME): the config names `node0` .. `node{n-1}`, all
pointing at one sshd on a free loopback port, with a fresh client key and a known_hosts entry
for its fresh host key. sshd is stopped and the directory removed afterwards. `MaxStartups` is
raised (OpenSSH's default 10:30:100 randomly drops unauthenticated connections beyond 10: the
fan-out's retries handle that on real clusters; here it would blur the per-connection cost).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

SSHD = "/usr/sbin/sshd"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def loopback_sshd(n: int) -> Iterator[tuple[str, str]]:
    if not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None:
        raise SystemExit("needs OpenSSH's sshd and ssh-keygen (apt-get install -y openssh-server)")
    base = Path(tempfile.mkdtemp(prefix="zerorun-sshd-"))
    home = base / "home"
    (home / ".ssh").mkdir(parents=True)
    os.makedirs("/run/sshd", exist_ok=True)
    key = home / ".ssh" / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    host_key = base / "host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True)
    authorized = base / "authorized_keys"
    shutil.copy(f"{key}.pub", authorized)
    port = _free_port()
    cfg = base / "sshd_config"
    cfg.write_text("\n".join([
        "ListenAddress 127.0.0.1", f"Port {port}", f"HostKey {host_key}", f"AuthorizedKeysFile {authorized}",
        f"PidFile {base}/sshd.pid", "StrictModes no", "PermitRootLogin prohibit-password",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
        f"MaxStartups {max(100, 2 * n)}", "MaxSessions 10", "LogLevel ERROR", "",
    ]))
    known = home / ".ssh" / "known_hosts"
    known.write_text(f"[127.0.0.1]:{port} {' '.join((base / 'host_key.pub').read_text().split()[:2])}\n")
    client_cfg = home / ".ssh" / "config"
    client_cfg.write_text("".join(
        f"Host node{i}\n  HostName 127.0.0.1\n  Port {port}\n  IdentityFile {key}\n  UserKnownHostsFile {known}\n"
        for i in range(n)
    ))
    log = open(base / "sshd.log", "wb")  # noqa: SIM115 - lives as long as sshd
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"sshd did not start: {(base / 'sshd.log').read_text()}")
            time.sleep(0.05)
        yield str(client_cfg), str(home)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(base, ignore_errors=True)
