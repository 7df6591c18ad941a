"""Per-node mode on the fake cluster: one `zerorun --nnodes 2 --node_rank R` per network
namespace, as a Kubernetes PyTorchJob or `srun --ntasks-per-node=1` would start them. They meet
through zerorun's own rendezvous on node 0 and fail fast together."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mn_helpers import SCRIPT, describe, launcher_env, wait_clean

pytestmark = pytest.mark.multinode


class NodeLaunch:
    """`python -m zerorun ...` inside one fake host's network namespace."""

    def __init__(self, node, args: list[str], *, env: dict[str, str], cwd: Path) -> None:  # type: ignore[no-untyped-def]
        self.node = node
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", node.netns, sys.executable, "-m", "zerorun", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**env, "GLOO_SOCKET_IFNAME": node.ifname},
            cwd=cwd,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return re.sub(r"^(\[[\w.-]+:\d+\]) +", r"\1 ", "\n".join(self.lines), flags=re.M)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.kill()
                raise AssertionError(f"{text!r} never appeared:\n{self.output}")
            time.sleep(0.05)

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"zerorun on {self.node.alias} did not exit within {timeout} s:\n{self.output}") from None
        self._reader.join(timeout=5)
        return code

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


def start_pair(cluster, tmp_path: Path, extra_env: dict[str, str], *extra: str) -> list[NodeLaunch]:  # type: ignore[no-untyped-def]
    port = random.randint(31000, 39000)
    env = launcher_env(cluster, **extra_env)
    master = cluster.nodes[0].addr
    common = ["--nnodes", "2", "--master_addr", master, "--master_port", str(port), "--device", "cpu",
              "--num_gpus", "1", "--grace_period", "2", "--pg_timeout", "60", *extra]
    # Node 1 first: it must wait for node 0 (the rendezvous retries until --rdzv_timeout).
    n1 = NodeLaunch(cluster.nodes[1], [*common, "--node_rank", "1", str(SCRIPT)], env=env, cwd=tmp_path)
    n0 = NodeLaunch(cluster.nodes[0], [*common, "--node_rank", "0", str(SCRIPT)], env=env, cwd=tmp_path)
    return [n0, n1]


def test_pernode_trains_and_fails_fast(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    nodes = cluster.nodes[:2]
    # 1. Trains: every rank's output on node 0's console, the same weights everywhere.
    n0, n1 = start_pair(cluster, tmp_path, {"MN_MODE": "train"})
    assert n0.finish(90) == 0, n0.output
    assert n1.finish(30) == 0, n1.output
    assert n0.output.splitlines()[0].startswith("zerorun: launcher pernode: auto: --nnodes 2 --node_rank 0"), n0.output
    assert re.search(r"\[\S+-n1:1\] SAME_WEIGHTS True", n0.output), n0.output  # node 1's rank, on node 0
    assert re.search(r"\[\S+-n0:0\] SAME_WEIGHTS True", n0.output), n0.output
    assert "world=2" in n1.output and "node_rank=1" in n1.output
    assert not wait_clean(nodes, 10)

    # 2. Killing one node's zerorun stops the other within 10 s (its link closes at once).
    n0, n1 = start_pair(cluster, tmp_path, {"MN_MODE": "loop"})
    n0.wait_for("-n1:1] STEP 10", 90)
    t0 = time.monotonic()
    n1.kill()
    code = n0.finish(15)
    assert time.monotonic() - t0 < 10, n0.output
    assert code == 255, n0.output
    assert "node 1" in n0.output and "was lost" in n0.output, n0.output
    left = wait_clean(nodes, 10)
    assert not left, describe(left)

    # 3. A failing rank on node 1: both nodes stop with its exit code.
    n0, n1 = start_pair(cluster, tmp_path, {"MN_MODE": "fail", "MN_FAIL_RANK": "1", "MN_FAIL_CODE": "3"})
    assert n1.finish(90) == 3, n1.output
    assert n0.finish(15) == 3, n0.output
    assert "failing on purpose" in n0.output  # the failing rank's stderr, on node 0's console
    left = wait_clean(nodes, 10)
    assert not left, describe(left)


def test_rendezvous_timeouts(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A node that never starts: node 0 gives up after --rdzv_timeout naming it; a node whose
    master never comes says it could not reach it. No torch is imported for either."""
    env = launcher_env(cluster)
    port = random.randint(31000, 39000)
    common = ["--nnodes", "2", "--master_port", str(port), "--device", "cpu", "--num_gpus", "1",
              "--rdzv_timeout", "2", str(SCRIPT)]
    alone0 = NodeLaunch(cluster.nodes[0], ["--node_rank", "0", "--master_addr", cluster.nodes[0].addr, *common],
                        env=env, cwd=tmp_path)
    alone1 = NodeLaunch(cluster.nodes[1], ["--node_rank", "1", "--master_addr", cluster.nodes[2].addr, *common],
                        env=env, cwd=tmp_path)
    assert alone0.finish(30) == 1, alone0.output
    assert "rendezvous timeout: node(s) 1 of 2 did not join within 2 s" in alone0.output, alone0.output
    assert alone1.finish(30) == 1, alone1.output
    assert f"could not reach node 0 at {cluster.nodes[2].addr}:{port + 1}" in alone1.output, alone1.output
    assert "Traceback" not in alone0.output + alone1.output
