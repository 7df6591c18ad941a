"""Multi-node jobs on the fake cluster: real sshd, real gloo ranks in separate namespaces.

Each launch is a real `python -m zerorun --hostfile ...`. The cluster's hostfile lists
node1..node3 with 2 slots and their own GLOO_SOCKET_IFNAME; node3's host key is not in the
test's known_hosts (used by the unknown-key test), so jobs select nodes with
--exclude/--include.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mn_helpers import (
    NAMED_SECRET,
    SCRIPT,
    UNNAMED_SECRET,
    Launch,
    describe,
    launcher_env,
    run_launcher,
    wait_clean,
)

pytestmark = pytest.mark.multinode

HELLO = SCRIPT.with_name("hello.py")
COMMON = ["--device", "cpu", "--pg_timeout", "60", "--grace_period", "3"]


def hostfile(cluster) -> str:  # type: ignore[no-untyped-def]
    return str(cluster.dir / "hostfile")


def test_training_job_across_two_nodes(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """One job checks: placement, per-host GLOO_SOCKET_IFNAME from the hostfile, ZeRO-3 training
    with zerorun's runtime (config validated here, used on the nodes), env propagation (prefixes,
    --env, the config's launcher.env / host_env) and secrets, verbatim hostile arguments,
    [host:rank] prefixes, events and summary across nodes, cleanup."""
    marker = tmp_path / "started"
    pwned = tmp_path / "pwned"
    hostile = [f"$(touch {pwned})", f"; touch {pwned}", f"`touch {pwned}`", "a b", "'\"", "--deepspeed_x"]
    config = tmp_path / "zero3.yaml"
    config.write_text(
        "train_micro_batch_size_per_gpu: 16\ngradient_accumulation_steps: 1\n"
        "optimizer: {type: AdamW, params: {lr: 0.02}}\nzero_optimization: {stage: 3}\n"
        "launcher:\n  env: {MN_FROM_CONFIG: 'yes'}\n  host_env: {node2: {MN_HOST_VALUE: two}}\n"
    )
    code, out = run_launcher(
        ["--hostfile", hostfile(cluster), "--exclude", "node3", *COMMON, "--log_dir", str(tmp_path / "logs"),
         "--config", str(config), "--env", "MN_API_TOKEN", "--env", f"MN_MARKER={marker}", "--env", "MN_MODE=zero",
         str(SCRIPT), *hostile],
        env=launcher_env(cluster),
        cwd=tmp_path,
    )
    assert code == 0, out
    infos = {int(m["rank"]): m for m in re.finditer(
        r"\[(?P<host>node\d):(?P<prefix>\d)\] INFO rank=(?P<rank>\d) world=4 local_rank=(?P<local>\d) "
        r"local_world=2 node_rank=(?P<node>\d) ifname=(?P<ifname>\S+) nccl_debug=(?P<nccl>\S+) "
        r"named_secret=(?P<named>\S+) unnamed_secret=(?P<unnamed>\S+)", out)}
    assert sorted(infos) == [0, 1, 2, 3], out
    import hashlib

    named_digest = hashlib.sha256(NAMED_SECRET.encode()).hexdigest()[:12]
    for rank, m in infos.items():
        node = cluster.nodes[rank // 2]
        assert m["host"] == node.alias and int(m["prefix"]) == rank
        assert int(m["node"]) == rank // 2 and int(m["local"]) == rank % 2
        assert m["ifname"] == node.ifname  # per-host value from the hostfile
        assert m["nccl"] == "INFO"  # a travelling prefix reached the remote rank
        assert m["named"] == named_digest  # named with --env: sent
        assert m["unnamed"] == "absent"  # looks secret, not named: not sent
    # Hostile arguments arrive verbatim and run nothing.
    assert out.count("ARGV " + repr(hostile)) == 4, out
    assert not pwned.exists()
    # The config's launcher.env and launcher.host_env reached the right ranks.
    values = re.findall(r"\[(node\d):\d\] CONFIG_ENV from_config=(\S+) host_value=(\S+)", out)
    assert sorted(values) == [("node1", "yes", "None")] * 2 + [("node2", "yes", "two")] * 2, out
    # ZeRO-3 training with zerorun's runtime across the nodes: the loss went down, and every
    # rank (same batches everywhere) saw the very same losses, so the shards stayed in sync.
    losses = re.findall(r"\[node\d:(\d)\] ZSTEP (\d+) loss ([\d.]+)", out)
    first = {r: v for r, s, v in losses if s == "0"}
    last = {r: v for r, s, v in losses if s == "29"}
    assert len(first) == len(last) == 4 and len(set(first.values())) == len(set(last.values())) == 1, losses
    assert float(last["0"]) < float(first["0"]) / 3, losses
    # Secrets are never printed, nor logged.
    assert "NCCL_SECRET_TOKEN looks secret and was not sent" in out
    logs = "".join(p.read_text() for p in (tmp_path / "logs").iterdir())
    for secret in (NAMED_SECRET, UNNAMED_SECRET):
        assert secret not in out and secret not in logs
    assert len(list(tmp_path.glob("started.rank*"))) == 4
    # Events crossed the SSH channels: every rank's memory snapshots reached the launcher.
    import json

    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert [(r["rank"], r["host"], r["state"]) for r in summary["ranks"]] == [
        (0, "node1", "exited"), (1, "node1", "exited"), (2, "node2", "exited"), (3, "node2", "exited")
    ]
    assert all(r["rss_peak"] and r["rss_peak"] > 50 << 20 for r in summary["ranks"]), summary
    events = [json.loads(line) for line in (tmp_path / "logs" / "events.jsonl").read_text().splitlines()]
    assert {e["rank"] for e in events if e["kind"] == "memory"} == {0, 1, 2, 3}
    left = wait_clean(cluster.nodes, 5)
    assert not left, describe(left)


def test_launcher_machine_as_master(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`localhost` first in the hostfile: rank 0 runs here (no SSH), and the remote rank gets
    this machine's address as the node sees it, not 127.0.0.1."""
    node1 = cluster.nodes[0]
    hf = tmp_path / "hosts"
    hf.write_text(f"localhost slots=1 GLOO_SOCKET_IFNAME={cluster.bridge}\nnode1 slots=1 GLOO_SOCKET_IFNAME={node1.ifname}\n")
    code, out = run_launcher(
        ["--hostfile", str(hf), *COMMON, "--env", "MN_MODE=train", str(SCRIPT)], env=launcher_env(cluster), cwd=tmp_path
    )
    assert code == 0, out
    assert re.search(rf"master {re.escape(cluster.subnet)}\.1:\d+", out), out
    assert "[localhost:0] SAME_WEIGHTS True" in out and "[node1:1] SAME_WEIGHTS True" in out, out


def test_selection_in_dry_run(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    code, out = run_launcher(
        ["--hostfile", hostfile(cluster), "--include", " node3 @ node1:1 ", "--dry-run", *COMMON,
         "--env", f"MN_API_TOKEN={NAMED_SECRET}", str(SCRIPT)],
        env=launcher_env(cluster),
        cwd=tmp_path,
    )
    assert code == 0, out
    table = [line.split() for line in out.splitlines() if re.match(r"^\d+\s+\d+\s+\d+\s+node", line)]
    # Node order follows the hostfile; node1 keeps slot 1 only, node3 (bare) all its slots.
    assert [(r[0], r[1], r[2], r[3]) for r in table] == [
        ("0", "0", "0", "node1"), ("1", "0", "1", "node3"), ("2", "1", "1", "node3")
    ], out
    assert "MN_API_TOKEN=<redacted>" in out and NAMED_SECRET not in out
    assert f"GLOO_SOCKET_IFNAME={cluster.nodes[2].ifname}" in out
    code, out = run_launcher(
        ["--hostfile", hostfile(cluster), "--num_nodes", "2", "--num_gpus", "1", "--dry-run", *COMMON, str(SCRIPT)],
        env=launcher_env(cluster),
        cwd=tmp_path,
    )
    assert code == 0 and re.search(r"^1\s+0\s+1\s+node2", out, re.M) and "node3" not in out, out
    code, out = run_launcher(
        ["--hostfile", hostfile(cluster), "--include", "node1:5", "--dry-run", *COMMON, str(SCRIPT)],
        env=launcher_env(cluster),
        cwd=tmp_path,
    )
    assert code != 0 and "slot(s) 5 of host 'node1' do not exist" in out and "Traceback" not in out, out


def test_rank_failing_on_node_b_stops_node_a(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 on node2 exits 3 while rank 0 on node1 sleeps (it would never end by itself):
    the launcher stops node1's rank through its agent and exits with rank 1's code."""
    launch = Launch(
        ["--hostfile", hostfile(cluster), "--include", "node1:0@node2:0", *COMMON,
         "--env", "MN_HANG=1", "--env", "MN_FAIL_RANK=1", "--env", "MN_FAIL_CODE=3",
         "--env", f"MN_READY={tmp_path / 'ready'}", str(HELLO)],
        env=launcher_env(cluster),
        cwd=tmp_path,
    )
    code = launch.finish(60)
    out = launch.output
    assert code == 3, out
    assert "[node2:1] failing on purpose" in out and "[node1:0] HELLO" in out
    assert "rank node2:1 failed first" in out and re.search(r"rank 1 on node2 \(pid \d+\): exit 3", out), out
    assert re.search(r"0\s+node1\s+signal 15 \(SIGTERM\) \(stopped\)", out), out
    left = wait_clean(cluster.nodes, 5)
    assert not left, describe(left)


def test_link_down_stops_the_job_everywhere(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    node1, node2 = cluster.nodes[:2]
    launch = Launch(
        ["--hostfile", hostfile(cluster), "--exclude", "node3", "--num_gpus", "1", *COMMON,
         "--env", "MN_MODE=loop", str(SCRIPT)],
        env=launcher_env(cluster, ZERORUN_SSH_HEARTBEAT_TIMEOUT="5"),
        cwd=tmp_path,
    )
    try:
        launch.wait_for(lambda o: "[node1:0] STEP 10" in o and "[node2:1] STEP 10" in o, 90)
        t0 = time.monotonic()
        cluster.link(node2, up=False)
        code = launch.finish(40)
        stopped_after = time.monotonic() - t0
        left = wait_clean([node1, node2], 10)
        clean_after = time.monotonic() - t0
    finally:
        cluster.link(node2, up=True)
    out = launch.output
    assert code == 255, out
    assert re.search(r"node node2 .* was lost: node2 \(\S+\) is unreachable", out), out
    # The heartbeat timeout is 5 s here; the process-group timeout (60 s) never comes into it.
    assert stopped_after < 20, (stopped_after, out)
    assert not left, describe(left)
    assert clean_after < 25, clean_after


@pytest.mark.parametrize("how", ["sigint", "sigkill"])
def test_launcher_interrupted_or_killed_leaves_nothing(cluster, tmp_path: Path, how: str) -> None:  # type: ignore[no-untyped-def]
    """Ctrl-C while the ranks are in gloo collectives across the nodes; SIGKILL of the launcher
    (ranks asleep: nothing but the agents' EOF can stop them)."""
    job = ["--env", "MN_MODE=loop", str(SCRIPT)] if how == "sigint" else ["--env", "MN_HANG=1", str(HELLO)]
    launch = Launch(
        ["--hostfile", hostfile(cluster), "--exclude", "node3", "--num_gpus", "1", *COMMON, *job],
        env=launcher_env(cluster),
        cwd=tmp_path,
    )
    if how == "sigint":
        launch.wait_for(lambda o: "[node1:0] STEP 10" in o and "[node2:1] STEP 10" in o, 90)
    else:
        launch.wait_for(lambda o: "[node1:0] HELLO" in o and "[node2:1] HELLO" in o, 60)
    assert all(n.job_pids() for n in cluster.nodes[:2])
    t0 = time.monotonic()
    if how == "sigint":
        launch.proc.send_signal(signal.SIGINT)
        code = launch.finish(30)
        assert code == 130, launch.output
    else:
        launch.proc.kill()  # the launcher alone, as the OOM killer would
        launch.finish(30)
    left = wait_clean(cluster.nodes, 15)
    assert not left, f"{how}: left after {time.monotonic() - t0:.1f} s:\n{describe(left)}"


def test_node_agent_killed_is_a_lost_node(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The agent on node2 dies (OOM killer, admin): its ranks die with it (parent-death
    signal), the launcher reports node2 lost, stops node1, exits 255."""
    node1, node2 = cluster.nodes[:2]
    launch = Launch(
        ["--hostfile", hostfile(cluster), "--exclude", "node3", "--num_gpus", "1", *COMMON,
         "--env", "MN_HANG=1", str(HELLO)],
        env=launcher_env(cluster),
        cwd=tmp_path,
    )
    launch.wait_for(lambda o: "[node1:0] HELLO" in o and "[node2:1] HELLO" in o, 60)
    agents = [p for p in node2.job_pids() if b"zerorun.launch.agent" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(agents) == 1, describe({"node2": node2.job_pids()})
    os.kill(agents[0], signal.SIGKILL)
    code = launch.finish(30)
    out = launch.output
    assert code == 255 and re.search(r"node node2 \(node rank 1\) was lost: the SSH connection to node2 \(\S+\) closed", out), out
    left = wait_clean([node1, node2], 10)
    assert not left, describe(left)


def test_hang_timeout_gets_stack_dumps_from_every_node(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """--hang_timeout: SIGUSR1 travels to the remote ranks (to the rank alone), their
    faulthandler dumps come back over SSH, the report says where each rank is."""
    code, out = run_launcher(
        ["--hostfile", hostfile(cluster), "--exclude", "node3", "--num_gpus", "1", *COMMON, "--hang_timeout", "3",
         "--env", "MN_HANG=1", str(HELLO)],
        env=launcher_env(cluster),
        cwd=tmp_path,
    )
    assert code == 124, out
    for where in ("node1:0", "node2:1"):
        assert re.search(rf"rank {where}: hello.py:\d+ in stuck_here", out), out
    left = wait_clean(cluster.nodes, 5)
    assert not left, describe(left)


def test_preflight_failures_start_nothing(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    marker = tmp_path / "started"
    env = launcher_env(cluster)
    hf = tmp_path / "hosts"

    def launch(lines: str, *extra: str) -> str:
        hf.write_text(lines)
        t0 = time.monotonic()
        code, out = run_launcher(
            ["--hostfile", str(hf), "--num_gpus", "1", *COMMON, *extra, "--env", f"MN_MARKER={marker}", str(SCRIPT)],
            env=env,
            cwd=tmp_path,
            timeout=60,
        )
        assert code != 0 and "Traceback" not in out, out
        assert time.monotonic() - t0 < 30, out
        assert not list(tmp_path.glob("started*")), f"a rank started:\n{out}"
        return out

    # Unreachable: an unassigned address of the test subnet (ConnectTimeout 2 in ssh config).
    out = launch("node1 slots=1\nunreachable slots=1\n")
    assert f"cannot reach unreachable ({cluster.unreachable_addr})" in out and "Nothing was started" in out
    # Unknown host key.
    out = launch("node1 slots=1\nnode3 slots=1\n")
    assert re.search(r"host key of node3 \(\S+\) is not in known_hosts", out) and "--ssh-accept-new-hosts" in out
    # Both at once: every failing host is named.
    out = launch("unreachable slots=1\nnode1 slots=1\nnode3 slots=1\n")
    assert "SSH failed on 2 nodes" in out and "unreachable" in out and "node3" in out
    # One table of which node, what, the fix (launch/fanout.py's failure_table), never a traceback.
    assert re.search(r"^\s+node\s+problem\s+(tries\s+)?what\s+fix$", out, re.M), out
    # Remote interpreter missing, remote cwd missing.
    out = launch("node1 slots=1\nnode2 slots=1\n", "--remote_python", "/nonexistent/bin/python")
    assert "the remote interpreter /nonexistent/bin/python does not exist there" in out
    assert "The preflight failed on 2 nodes: 2 python" in out and re.search(r"^\s+node2 \S+\s+python\s", out, re.M), out
    cwd = f"/nonexistent dir; touch {tmp_path}/pwned"
    out = launch("node1 slots=1\n", "--remote_cwd", cwd)
    assert f"cannot enter the working directory {cwd}" in out and not (tmp_path / "pwned").exists()
    # The script is not on the nodes (no shared file system).
    hf.write_text("node1 slots=1\n")
    (tmp_path / "relative").mkdir()
    (tmp_path / "relative" / "train.py").write_text("print('should not run')\n")
    code, out = run_launcher(["--hostfile", str(hf), *COMMON, "--remote_cwd", "/", "relative/train.py"], env=env, cwd=tmp_path)
    assert code != 0 and "the script relative/train.py does not exist there (working directory /)" in out, out
    # Master port busy here, where the master (localhost, first in the hostfile) runs.
    import socket

    with socket.socket() as busy_here:
        busy_here.bind(("", 0))
        busy_here.listen()
        port_here = busy_here.getsockname()[1]
        out = launch("localhost slots=1\nnode1 slots=1\n", "--master_port", str(port_here))
        assert f"master port {port_here} is already in use on this machine, where rank 0 runs" in out
    # Master port busy on the (remote) master.
    busy = subprocess.Popen(
        ["ip", "netns", "exec", cluster.nodes[0].netns, sys.executable, "-c",
         "import socket,sys,time; s=socket.socket(); s.bind(('',0)); s.listen(); "
         "print(s.getsockname()[1], flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert busy.stdout is not None
        port = busy.stdout.readline().strip()
        out = launch("node1 slots=1\nnode2 slots=1\n", "--master_port", port)
        assert f"master port {port} is already in use there" in out
    finally:
        busy.kill()
        busy.wait()


def test_host_keys_accept_new_and_changed(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    home = tmp_path / "home"
    shutil.copytree(cluster.home, home)
    env = launcher_env(cluster, HOME=str(home))
    known = home / ".ssh" / "known_hosts"
    node3 = cluster.nodes[2]
    hf = tmp_path / "hosts"
    hf.write_text(f"node3 slots=1 GLOO_SOCKET_IFNAME={node3.ifname}\n")
    args = ["--hostfile", str(hf), *COMMON, str(HELLO)]
    code, out = run_launcher(["--ssh-accept-new-hosts", *args], env=env, cwd=tmp_path)
    assert code == 0 and "[node3:0] HELLO rank=0 node_rank=0" in out, out
    assert cluster.known_hosts_line(node3) in known.read_text()
    # A changed key is refused even with --ssh-accept-new-hosts.
    wrong = cluster.known_hosts_line(cluster.nodes[0]).split(" ", 1)[1]
    known.write_text(f"{node3.addr} {wrong}\n")
    code, out = run_launcher(["--ssh-accept-new-hosts", *args], env=env, cwd=tmp_path)
    assert code != 0 and "host key of node3" in out and "has CHANGED" in out and "ssh-keygen -R" in out, out
    assert "Traceback" not in out


def test_ssh_config_port_and_proxy_jump(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """~/.ssh/config as ssh reads it: `node1-alt` is node1 on port 2222 (known_hosts entry
    `[addr]:2222`); `inside-node1` is 127.0.0.1 *as seen from node1*, reachable only through
    ProxyJump node1 (the launcher's own loopback has no sshd), both hops' keys checked."""
    home = tmp_path / "home"
    shutil.copytree(cluster.home, home)
    node1 = cluster.nodes[0]
    key = home / ".ssh" / "id_ed25519"
    with (home / ".ssh" / "config").open("a") as fh:
        fh.write(f"Host inside-node1\n    HostName 127.0.0.1\n    User root\n    ProxyJump node1\n    IdentityFile {key}\n"
                 f"Host node1-alt\n    HostName {node1.addr}\n    Port 2222\n    User root\n    IdentityFile {key}\n")
    with (home / ".ssh" / "known_hosts").open("a") as fh:
        fh.write(f"127.0.0.1 {node1.host_key_pub}\n[{node1.addr}]:2222 {node1.host_key_pub}\n")
    hf = tmp_path / "hosts"
    hf.write_text("inside-node1 slots=1\nnode1-alt slots=1\n")
    code, out = run_launcher(["--hostfile", str(hf), *COMMON, str(HELLO), "x"], env=launcher_env(cluster, HOME=str(home)),
                             cwd=tmp_path)
    assert code == 0, out
    assert "[inside-node1:0] HELLO rank=0 node_rank=0" in out and "[node1-alt:1] HELLO rank=1 node_rank=1" in out, out
    # The port-22 entry of the same address does not vouch for port 2222.
    (home / ".ssh" / "known_hosts").write_text(cluster.known_hosts_line(node1) + "\n")
    hf.write_text("node1-alt slots=1\n")
    code, out = run_launcher(["--hostfile", str(hf), *COMMON, str(HELLO)], env=launcher_env(cluster, HOME=str(home)),
                             cwd=tmp_path)
    assert code != 0 and f"host key of node1-alt ({node1.addr}:2222) is not in known_hosts" in out
    assert f"ssh-keyscan -p 2222 {node1.addr}" in out, out


def test_bad_hostfiles_and_hostile_hosts_via_cli(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pwned = tmp_path / "pwned"
    env = launcher_env(cluster)
    cases = {
        "missing": (None, "does not exist"),
        "hostile": (f"node1 slots=1\n$(touch {pwned}) slots=1\n", "'$(touch' is not a host name"),
        "slots": ("node1 slots=two\n", "slots='two' for host 'node1' is not a whole number"),
        "env": ("node1 slots=1 ;touch${IFS}x\n", "unexpected ';touch${IFS}x'"),
        "plan var": ("node1 slots=1 RANK=3\n", "RANK is set by the launcher"),
    }
    for name, (text, fragment) in cases.items():
        hf = tmp_path / f"hosts-{name.replace(' ', '-')}"
        if text is not None:
            hf.write_text(text)
        code, out = run_launcher(["--hostfile", str(hf), *COMMON, str(SCRIPT)], env=env, cwd=tmp_path, timeout=60)
        assert code != 0 and fragment in out and "Traceback" not in out, (name, out)
        if text is not None:  # the bad line as the failure table's row (launch/fanout.py): file:line host
            assert re.search(rf"^  {re.escape(str(hf))}:\d \S+\s+\S", out, re.M), (name, out)
    assert not pwned.exists()
    # Bad selections and variables on the command line: clear errors before any connection.
    options = {
        "unknown host": (["--include", "node9"], "names host 'node9', which is not in hostfile"),
        "too many nodes": (["--num_nodes", "4"], "--num_nodes 4 but only 3 node(s)"),
        "plan variable": (["--env", "MASTER_ADDR=evil"], "MASTER_ADDR is set by the launcher"),
        "unset variable": (["--env", "MN_NOT_SET_ANYWHERE"], "MN_NOT_SET_ANYWHERE is not set in the launcher's environment"),
    }
    for name, (extra, fragment) in options.items():
        code, out = run_launcher(["--hostfile", hostfile(cluster), *COMMON, *extra, str(SCRIPT)], env=env, cwd=tmp_path, timeout=60)
        assert code != 0 and fragment in out and "Traceback" not in out, (name, out)
