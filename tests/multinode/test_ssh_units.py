"""Pure pieces of the SSH side: ssh config resolution, command quoting, the wire codec, the
agent's preflight answer. No network beyond binding a loopback port."""

from __future__ import annotations

import shlex
import socket
from pathlib import Path

import pytest

from zerorun.errors import LaunchError
from zerorun.launch import wire
from zerorun.launch.agent import hello
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


def test_wire_lines_and_banners() -> None:
    line = wire.encode("out", rank=3, stream="stdout", line="héllo {json} \x00")
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert wire.decode(line) == {"t": "out", "rank": 3, "stream": "stdout", "line": "héllo {json} \x00"}
    assert wire.decode(b"Welcome to node1! Last login: ...") is None
    assert wire.decode(b"[1, 2]") is None and wire.decode(b'{"no": "type"}') is None


def test_plan_round_trips_through_the_wire() -> None:
    hosts = parse_hostfile_text("n1 slots=2 GLOO_SOCKET_IFNAME=eth9\nn2 slots=1\n")
    opts = LaunchOptions(target=Target(script="train.py", args=("--x", "a b", "$(id)")), device="cpu")
    plan = build_plan(
        opts,
        hosts,
        DeviceInfo(gpus=(), cores=8),
        master_port=29500,
        run_id="r1",
        config_json='{"a": 1}',
        node_env={"n1": {"NCCL_DEBUG": "INFO"}},
        cwd="/work",
    )
    data = wire.decode(wire.encode("plan", plan=wire.plan_to_dict(plan)))
    assert data is not None
    again = wire.plan_from_dict(data["plan"])
    assert again == plan
    assert again.rank_env(again.nodes[1].ranks[0]) == plan.rank_env(plan.nodes[1].ranks[0])
    # Unknown fields from a newer launcher are ignored, not fatal.
    extra = wire.plan_to_dict(plan) | {"future_field": 1}
    assert wire.plan_from_dict(extra) == plan


def test_hello_reports_addresses_and_checks_the_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSH_CONNECTION", "10.0.0.1 50000 10.0.0.7 22")
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        info = hello({"check_port": port})
        assert info["client_addr"] == "10.0.0.1" and info["server_addr"] == "10.0.0.7"
        assert info["error"] and f"master port {port} is already in use" in info["error"]
    assert hello({"check_port": port})["error"] is None
    picked = hello({"pick_port": True})
    assert picked["error"] is None and 0 < picked["port"] < 65536
    assert hello({})["port"] is None
    missing = hello({"script": "no/such/train.py", "check_port": 1})
    assert "the script no/such/train.py does not exist there" in missing["error"]
    assert hello({"script": __file__})["error"] is None


def test_missing_paramiko_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from zerorun.launch import ssh

    monkeypatch.setitem(sys.modules, "paramiko", None)  # `import paramiko` raises ImportError
    hosts = parse_hostfile_text("n1 slots=1\n")
    opts = LaunchOptions(target=Target(script="x.py"), device="cpu")
    plan = build_plan(opts, hosts, DeviceInfo(gpus=(), cores=2), master_port=29500, run_id="r")
    with pytest.raises(LaunchError, match="need paramiko"):
        ssh.prepare(plan, opts)


def test_one_node_runs_never_import_paramiko() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import zerorun.launch.ssh, zerorun.launch.remote, zerorun.launch.agent, zerorun.launch.hosts, "
        "zerorun.launch.environment, zerorun.cli; assert 'paramiko' not in sys.modules; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_preflight_answers_are_checked() -> None:
    """Version mismatch, a node's own problem, an agent that died before answering."""
    import queue
    from types import SimpleNamespace

    from zerorun.launch.remote import _collect_hellos

    def channel(*messages: object, stderr: tuple[str, ...] = (), code: int | None = 1) -> object:
        q: queue.Queue[object] = queue.Queue()
        for m in messages:
            q.put(m)
        return SimpleNamespace(
            messages=q, stderr_tail=list(stderr), exit_status=lambda timeout=2.0: code,
            target=SimpleNamespace(display="nodeX (10.0.0.9)"),
        )

    ok = {"t": "hello", "version": "1.0", "protocol": wire.PROTOCOL_VERSION}
    channels = {
        "a": channel(ok),
        "b": channel({"t": "hello", "version": "0.9", "protocol": wire.PROTOCOL_VERSION}),
        "c": channel(ok | {"error": "master port 1 is already in use there"}),
        "d": channel(None, stderr=("/usr/bin/python3: No module named zerorun",)),
        "e": channel(None, stderr=("bash: /opt/py/bin/python: No such file or directory",), code=127),
        "f": channel(),  # silent
    }
    hellos, errors = _collect_hellos(channels, "/opt/py/bin/python", "/work", "1.0", timeout=0.2)  # type: ignore[arg-type]
    assert list(hellos) == ["a"]
    assert "imports zerorun 0.9, this launcher is zerorun 1.0" in errors["b"]
    assert errors["c"] == "nodeX (10.0.0.9): master port 1 is already in use there"
    assert "cannot import zerorun" in errors["d"]
    assert "the remote interpreter /opt/py/bin/python does not exist there" in errors["e"]
    assert "did not answer within 0.2 s" in errors["f"]


def test_device_check_against_the_nodes_gpus() -> None:
    from zerorun.launch.remote import check_devices

    hosts = parse_hostfile_text("n1 slots=2\nn2 slots=4\n")
    no_local_gpu = DeviceInfo(gpus=(), cores=2)
    cuda = build_plan(LaunchOptions(target=Target(script="t.py"), device="cuda"), hosts, no_local_gpu,
                      master_port=1, run_id="r")
    assert cuda.device == "cuda" and cuda.nodes[1].visible_devices == ("0", "1", "2", "3")
    check_devices(cuda, {"n1": {"gpus": 2}, "n2": {"gpus": 8}}, auto=False)
    with pytest.raises(LaunchError, match=r"n2 has 2 GPU\(s\), but the job uses its slot\(s\) 0, 1, 2, 3"):
        check_devices(cuda, {"n1": {"gpus": 2}, "n2": {"gpus": 2}}, auto=False)
    cpu = build_plan(LaunchOptions(target=Target(script="t.py")), hosts, no_local_gpu, master_port=1, run_id="r")
    assert cpu.device == "cpu"
    with pytest.raises(LaunchError, match="the nodes have GPUs \\(n2\\) but this machine has none"):
        check_devices(cpu, {"n1": {"gpus": 0}, "n2": {"gpus": 8}}, auto=True)
    check_devices(cpu, {"n1": {"gpus": 0}, "n2": {"gpus": 8}}, auto=False)  # --device cpu: as asked
    check_devices(cpu, {"n1": {"gpus": 0}, "n2": {"gpus": 0}}, auto=True)
    # A job with a local node still needs local GPUs for --device cuda.
    with pytest.raises(LaunchError, match="no GPU is visible"):
        build_plan(LaunchOptions(target=Target(script="t.py"), device="cuda"),
                   parse_hostfile_text("localhost slots=1\nn2 slots=1\n"), no_local_gpu, master_port=1, run_id="r")


def test_refused_connection_names_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from zerorun.launch.ssh import connect_nodes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    cfg = tmp_path / "config"
    cfg.write_text(f"Host closed-node\n  HostName 127.0.0.1\n  Port {port}\n  ConnectTimeout 3\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(LaunchError, match=rf"cannot reach closed-node \(127.0.0.1:{port}\): .*Nothing was started"):
        connect_nodes(["closed-node"], SshOptions(ssh_config=str(cfg)))
