"""Fault tolerance on the fake cluster. --max_restarts with --exclude_failed_nodes
(launch/restart.py): a node's link drops in the middle of training; the launcher loses it
(short heartbeat timeout), stops the other node, and the second attempt runs on the remaining
node at half the world size, resuming from the last periodic checkpoint, to the end.
--save_on_preemption: SIGTERM to one node's agent (as a scheduler stopping that node would)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from mn_helpers import Launch, describe, launcher_env, wait_clean

pytestmark = pytest.mark.multinode

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "runtime" / "checkpoint" / "_ft_worker.py"
STEPS = 12


def _config(out: Path) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 150},
        "steps_per_print": 1000,
        "zerorun": {"checkpoint": {"dir": str(out / "ckpt"), "auto_resume": True, "every_n_steps": 2}},
    }


def _wait_for_steps(out: Path, launch: Launch, steps: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    losses = out / "losses_rank0.jsonl"
    while not (losses.exists() and len(losses.read_text().splitlines()) >= steps):
        assert time.monotonic() < deadline and launch.proc.poll() is None, launch.output
        time.sleep(0.1)


def test_sigterm_to_a_node_agent_saves_on_every_node(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """With --save_on_preemption the agent passes SIGTERM to its rank instead of killing it; the
    ranks of both nodes agree on a step, save it and exit 75; the launcher says so."""
    node1, node2 = cluster.nodes[:2]
    out = tmp_path / "out"
    out.mkdir()
    launch = Launch(
        ["--hostfile", str(cluster.dir / "hostfile"), "--include", "node1:0@node2:0", "--device", "cpu",
         "--pg_timeout", "60", "--grace_period", "3", "--save_on_preemption",
         "--env", f"FT_CONFIG={json.dumps(_config(out))}", "--env", f"FT_OUT={out}",
         "--env", f"FT_STEPS={STEPS}", "--env", "FT_SLOW=0.3", str(WORKER)],
        env=launcher_env(cluster),
        cwd=tmp_path,
    )
    _wait_for_steps(out, launch, 3, 120)
    agents = [p for p in node2.job_pids() if b"zerorun.launch.agent" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(agents) == 1, describe({"node2": node2.job_pids()})
    os.kill(agents[0], signal.SIGTERM)
    code = launch.finish(90)
    output = launch.output
    assert code == 75, output
    saved = (out / "ckpt" / "latest").read_text()
    assert f"preempted; checkpoint {saved} saved" in output and "rank 1 got SIGTERM" in output, output
    assert int(saved.removeprefix("global_step")) >= 3
    left = wait_clean([node1, node2], 10)
    assert not left, describe(left)


def test_lost_node_is_left_out_and_the_job_resumes_on_the_rest(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    node1, node2 = cluster.nodes[:2]
    out = tmp_path / "out"
    out.mkdir()
    config = _config(out)
    logs = tmp_path / "logs"
    launch = Launch(
        ["--hostfile", str(cluster.dir / "hostfile"), "--include", "node1:0@node2:0", "--device", "cpu",
         "--pg_timeout", "60", "--grace_period", "3", "--max_restarts", "1", "--exclude_failed_nodes",
         "--log_dir", str(logs), "--env", f"FT_CONFIG={json.dumps(config)}", "--env", f"FT_OUT={out}",
         "--env", f"FT_STEPS={STEPS}", "--env", "FT_SLOW=0.3", str(WORKER)],
        env=launcher_env(cluster, ZERORUN_SSH_HEARTBEAT_TIMEOUT="5"),
        cwd=tmp_path,
    )
    losses = out / "losses_rank0.jsonl"
    try:
        _wait_for_steps(out, launch, 5, 120)
        cluster.link(node2, up=False)
        code = launch.finish(180)
    finally:
        cluster.link(node2, up=True)
    output = launch.output
    assert code == 0, output
    summary = json.loads((logs / "summary.json").read_text())
    first, second = summary["attempts"]
    assert (first["exit_code"], first["reason"], second["exit_code"]) == (255, "node_lost", 0), summary
    assert "leaving out node2 (1 node(s) left)" in first["why"]
    assert "attempt 2/2 (restart)" in output
    # The second attempt: one rank on node1, resumed from a periodic save made before the link
    # dropped, trained to the end.
    attempt2 = json.loads((logs / "attempt2" / "summary.json").read_text())
    assert [(r["rank"], r["host"], r["state"]) for r in attempt2["ranks"]] == [(0, "node1", "exited")]
    rows = [json.loads(x) for x in losses.read_text().splitlines()]
    resumed = [r for r in rows if r["resumed_from"]]
    start = int(resumed[0]["resumed_from"].rsplit("global_step", 1)[1])
    assert start >= 4 and [r["step"] for r in resumed] == list(range(start + 1, STEPS + 1))
    assert (out / "final" / "latest").read_text() == "final"
    left = wait_clean([node1, node2], 10)
    assert not left, describe(left)
