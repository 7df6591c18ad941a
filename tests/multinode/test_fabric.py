"""The fake-cluster set-up removes what a crashed earlier run left behind, and nothing else."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import mn_fabric as fabric
import pytest

pytestmark = pytest.mark.multinode


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_cleanup_stale_removes_leftovers_of_dead_runs_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fabric.STATE_DIR.mkdir(parents=True, exist_ok=True)
    made = {
        "dead": ("zrmn-dead1-1", "zrbdead1", _dead_pid()),  # a run that crashed after saving state
        "live": ("zrmn-live1-1", "zrblive1", os.getpid()),  # a run still going (this process)
    }
    try:
        for run_id, (netns, bridge, owner) in [("dead1", made["dead"]), ("live1", made["live"])]:
            fabric.sh("ip", "netns", "add", netns)
            fabric.sh("ip", "link", "add", bridge, "type", "bridge")
            state = {"owner": owner, "run_id": run_id, "bridge": bridge, "netns": [netns], "dir": str(tmp_path / run_id)}
            (fabric.STATE_DIR / f"{run_id}.json").write_text(json.dumps(state))
        fabric.sh("ip", "netns", "add", "zrmn-orph1-1")  # no state file at all
        fabric.cleanup_stale()
        netns = fabric.sh("ip", "netns", "list").stdout
        links = fabric.sh("ip", "-o", "link", "show").stdout
        assert "zrmn-dead1-1" not in netns and "zrbdead1" not in links
        assert "zrmn-orph1-1" not in netns
        assert not (fabric.STATE_DIR / "dead1.json").exists()
        assert "zrmn-live1-1" in netns and "zrblive1" in links
    finally:
        for name in ("zrmn-dead1-1", "zrmn-live1-1", "zrmn-orph1-1"):
            fabric.sh("ip", "netns", "del", name, check=False)
        for name in ("zrbdead1", "zrblive1"):
            fabric.sh("ip", "link", "del", name, check=False)
        for run_id in ("dead1", "live1"):
            (fabric.STATE_DIR / f"{run_id}.json").unlink(missing_ok=True)


def test_fake_hosts_have_their_own_names(cluster) -> None:  # type: ignore[no-untyped-def]
    """Each fake host says its own host name and resolves every node's name to that node's
    address (UTS + mount namespaces), as machines of a cluster do; names added later
    (fabric.add_names, a pod's DNS name) resolve too."""
    home = cluster.home / ".ssh"
    ssh = ["ssh", "-F", str(home / "config"), "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={home / 'known_hosts'}"]
    fabric.add_names(cluster, {cluster.nodes[1].addr: ["fabric-test-alias.svc"]})
    for node in cluster.nodes[:2]:
        out = subprocess.run([*ssh, node.alias, "hostname; getent hosts node1 node2 fabric-test-alias.svc"],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        assert out.returncode == 0, out.stderr
        lines = [line.split() for line in out.stdout.splitlines()]
        assert lines[0] == [node.alias], out.stdout
        assert [ln[0] for ln in lines[1:]] == [cluster.nodes[0].addr, cluster.nodes[1].addr, cluster.nodes[1].addr]
    assert socket.gethostname() not in {n.alias for n in cluster.nodes}  # the root namespace keeps its own
