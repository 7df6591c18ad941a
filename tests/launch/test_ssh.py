"""launch/ssh.py: ssh config resolution, command quoting, clear errors without paramiko or a
reachable node. No network beyond binding a loopback port."""

from __future__ import annotations

import shlex
import socket
from pathlib import Path

import pytest

from zerorun.errors import LaunchError
from zerorun.launch.hosts import parse_hostfile_text
from zerorun.launch.plan import DeviceInfo, LaunchOptions, Target, build_plan
from zerorun.launch.ssh import SshOptions, agent_command, resolve_target


def test_ssh_config_is_honoured(tmp_path: Path) -> None:
    cfg = tmp_path / "config"
    cfg.write_text(
        "Host gpu1\n  HostName 10.1.2.3\n  Port 2222\n  User alice\n  IdentityFile ~/.ssh/cluster_key\n"
        "  ConnectTimeout 4\n  UserKnownHostsFile /etc/cluster_hosts ~/.ssh/kh2\n"
        "Host *\n  User bob\n"
    )
    t = resolve_target("gpu1", SshOptions(ssh_config=str(cfg)))
    assert (t.hostname, t.port, t.user, t.connect_timeout) == ("10.1.2.3", 2222, "alice", 4.0)
    assert t.identity_files == (str(Path("~/.ssh/cluster_key").expanduser()),)
    assert t.known_hosts_files == ("/etc/cluster_hosts", str(Path("~/.ssh/kh2").expanduser()))
    assert t.known_hosts_name == "[10.1.2.3]:2222"
    assert t.display == "gpu1 (10.1.2.3:2222)"
    assert t.proxy_jump == ()
    cfg.write_text(cfg.read_text().replace("Host *", "Host behind\n  ProxyJump gpu1, bob@bastion:2200\nHost *"))
    assert resolve_target("behind", SshOptions(ssh_config=str(cfg))).proxy_jump == ("gpu1", "bob@bastion:2200")
    other = resolve_target("plain-host", SshOptions(ssh_config=str(cfg), connect_timeout=1.5))
    assert (other.hostname, other.port, other.user, other.connect_timeout) == ("plain-host", 22, "bob", 1.5)
    assert other.known_hosts_name == "plain-host" and other.display == "plain-host"


def test_ssh_port_option_sets_every_nodes_port(tmp_path: Path) -> None:
    """--ssh-port (DeepSpeed's --ssh_port) wins over ~/.ssh/config's Port, for every node."""
    from zerorun.launch.remote import ssh_options_from

    cfg = tmp_path / "config"
    cfg.write_text("Host gpu1\n  HostName 10.1.2.3\n  Port 2200\n")
    options = ssh_options_from(LaunchOptions(target=Target(script="t.py"), ssh_port=2222))
    assert options.port == 2222 and ssh_options_from(LaunchOptions(target=Target(script="t.py"))).port is None
    for alias, hostname in (("gpu1", "10.1.2.3"), ("plain", "plain")):
        t = resolve_target(alias, SshOptions(ssh_config=str(cfg), port=2222))
        assert (t.hostname, t.port, t.known_hosts_name) == (hostname, 2222, f"[{hostname}]:2222")
    assert resolve_target("gpu1", SshOptions(ssh_config=str(cfg))).port == 2200


def test_bad_port_in_ssh_config(tmp_path: Path) -> None:
    cfg = tmp_path / "config"
    cfg.write_text("Host x\n  Port twenty\n")
    with pytest.raises(LaunchError, match="Port 'twenty' for host x is not a number"):
        resolve_target("x", SshOptions(ssh_config=str(cfg)))


def test_agent_command_quotes_everything() -> None:
    cwd = "/data/my dir/$(touch /tmp/x);`id`"
    python = "/opt/py env/bin/python'; rm -rf /"
    cmd = agent_command(python, cwd)
    assert shlex.split(cmd) == ["cd", "--", cwd, "&&", "exec", python, "-u", "-m", "zerorun.launch.agent"]


def test_missing_paramiko_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from zerorun.launch import remote

    monkeypatch.setitem(sys.modules, "paramiko", None)  # `import paramiko` raises ImportError
    hosts = parse_hostfile_text("n1 slots=1\n")
    opts = LaunchOptions(target=Target(script="x.py"), device="cpu")
    plan = build_plan(opts, hosts, DeviceInfo(gpus=(), cores=2), master_port=29500, run_id="r")
    with pytest.raises(LaunchError, match="need paramiko"):
        remote.prepare(plan, opts)


def test_one_node_runs_never_import_paramiko() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import zerorun.launch.ssh, zerorun.launch.remote, zerorun.launch.agent, zerorun.launch.hosts, "
        "zerorun.launch.environment, zerorun.cli; assert 'paramiko' not in sys.modules; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_refused_connection_names_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from zerorun.launch.ssh import connect_nodes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    cfg = tmp_path / "config"
    cfg.write_text(f"Host closed-node\n  HostName 127.0.0.1\n  Port {port}\n  ConnectTimeout 3\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(LaunchError) as err:
        connect_nodes(["closed-node"], SshOptions(ssh_config=str(cfg), retry_backoff_s=0.01))
    # One node fails as many do: the table (launch/fanout.py), the fix in its own column.
    head, columns, row, last = str(err.value).splitlines()
    assert head == "SSH failed on 1 node: 1 unreachable" and columns.split() == ["node", "problem", "tries", "what", "fix"]
    assert row.split()[:3] == ["closed-node", "unreachable", "3"]  # refused: retried
    assert f"cannot reach closed-node (127.0.0.1:{port}): " in row and "Check the name/address in the hostfile" in row
    assert last == "Nothing was started."
