"""The scale simulation transport at CI size: 32 nodes x 8 synthetic ranks through the real
supervisor, console, link runners and node agents (launch/simulate.py)."""

from __future__ import annotations

import io
import re
import time

import pytest

from zerorun.errors import LaunchError
from zerorun.launch.console import PlainConsole
from zerorun.launch.simulate import Scenario, SimCluster, prepare, sim_plan
from zerorun.launch.supervisor import Supervisor
from zerorun.launch.synthetic import WARNING_TEXT

NODES, RANKS = 32, 8


def _run(scenario: Scenario, *, heartbeat_timeout_s: float = 10.0, grace: float = 1.0, tmp_path=None, **prep):
    cluster = SimCluster.start(NODES, scenario)
    try:
        plan = sim_plan(NODES, RANKS)
        plan, runners = prepare(plan, cluster, heartbeat_timeout_s=heartbeat_timeout_s, **prep)
        out, err = io.StringIO(), io.StringIO()
        t0 = time.monotonic()
        result = Supervisor(plan, runners, PlainConsole(out=out, err=err), grace_period=grace,
                            log_dir=tmp_path).run()
        wall = time.monotonic() - t0
    finally:
        totals = cluster.close()
    return result, totals, out.getvalue(), err.getvalue(), wall


def test_one_rank_fails_every_rank_everywhere_stops_and_nothing_is_left(tmp_path):
    sc = Scenario(line_rate=2.0, warn_interval_s=0.5, fail={123: (1.0, 7)}, hang={200: 0.0})
    result, totals, out, err, wall = _run(sc, tmp_path=tmp_path)
    assert result.exit_code == 7 and result.reason == "rank_failed"
    assert result.first_failure == 123
    assert "sim-0015:123 failed" in result.message
    states = {s.rank: s.state for s in result.ranks}
    assert states[123] == "failed"
    # rank 200 ignores SIGTERM: only the SIGKILL after the grace period stops it
    assert next(s for s in result.ranks if s.rank == 200).returncode == -9
    assert all(st in ("stopped", "failed") for st in states.values()), set(states.values())
    assert wall < 1.0 + 1.0 + 5.0  # failure at 1 s, grace 1 s, then the kill
    # every agent and every synthetic rank gone once the launcher is done
    assert totals["agents"] == NODES and totals["ranks_started"] == NODES * RANKS
    assert totals["agents_left"] == 0 and totals["ranks_left"] == 0 and totals["hosts_failed"] == 0
    # 256 ranks: the large-job console (rank 0's lines, every warning once with its ranks) ...
    assert out and all(line.startswith("[sim-0000:0] ") for line in out.splitlines())
    warnings = [line for line in err.splitlines() if WARNING_TEXT in line and not line.startswith("[sim-")]
    assert 1 <= len(warnings) <= 4 and warnings[0].startswith("[0-"), warnings
    assert "[123] RuntimeError: synthetic failure of rank 123" in err
    assert "sim-0015:123 failed (exit 7)" in err
    # ... and every line of every rank in the log files
    assert (tmp_path / "rank255.log").read_text().startswith("step 1 ")
    assert WARNING_TEXT in (tmp_path / "rank201.log").read_text()
    assert "RuntimeError: synthetic failure of rank 123" in (tmp_path / "rank123.log").read_text()


def test_a_silent_node_is_detected_named_and_the_job_stopped():
    sc = Scenario(line_rate=1.0, silent={9: 0.5})
    result, totals, _, err, wall = _run(sc, heartbeat_timeout_s=3.0)
    assert result.exit_code == 255 and result.reason == "node_lost"
    assert "sim-0009" in result.message and "no heartbeat" in result.message
    lost = {s.rank for s in result.ranks if s.state == "lost"}
    assert lost == set(range(9 * RANKS, 10 * RANKS))
    assert wall < 0.5 + 3.0 + 1.5 + 1.0 + 4.0  # silence, timeout, a heartbeat period, grace, slack
    assert totals["ranks_left"] == 0 and totals["agents_left"] == 0
    assert "sim-0009" in err


def test_connect_retries_transient_failures_and_tables_the_rest():
    sc = Scenario(connect_failures={3: 1, 9: 99, 20: 99}, version_mismatch=(4,))
    cluster = SimCluster.start(NODES, sc)
    try:
        with pytest.raises(LaunchError) as info:
            prepare(sim_plan(NODES, RANKS), cluster, retries=2, backoff_s=0.01)
    finally:
        totals = cluster.close()
    text = str(info.value)
    assert "Connecting failed on 2 nodes: 2 unreachable" in text
    assert re.search(r"sim-0009\s+unreachable\s+3\s", text) and "sim-0020" in text
    assert "sim-0003" not in text  # refused once, then connected
    assert "Nothing was started" in text
    assert totals["ranks_started"] == 0 and totals["refused"] == 1 + 3 + 3
    # the version check runs when every node connected
    cluster = SimCluster.start(NODES, Scenario(version_mismatch=(4,)))
    try:
        with pytest.raises(LaunchError, match=r"(?s)The preflight failed on 1 node: 1 version.*sim-0004\s+version"):
            prepare(sim_plan(NODES, RANKS), cluster)
    finally:
        assert cluster.close()["ranks_started"] == 0


def test_a_node_gets_only_its_own_part_of_the_plan():
    from zerorun.launch import wire

    plan = sim_plan(1000, 8)
    t0 = time.monotonic()
    sent = [wire.encode("plan", plan=wire.plan_to_dict(plan, n)) for n in range(1000)]
    assert time.monotonic() - t0 < 10.0  # converted once, not per node (was ~1 MB each)
    assert max(len(s) for s in sent) < 4000
    again = wire.plan_from_dict(wire.decode(sent[537])["plan"])
    assert len(again.nodes) == 1000 and again.nodes[537] == plan.nodes[537] and not again.nodes[3].ranks
    for spec in plan.nodes[537].ranks:
        assert again.rank_env(spec) == plan.rank_env(spec)


def test_launcher_sim_runs_the_whole_cli_pipeline(tmp_path):
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "hosts").write_text("".join(f"node{i:03d} slots=4\n" for i in range(40)))
    (tmp_path / "train.py").write_text("raise SystemExit('never runs: the ranks are synthetic')\n")
    (tmp_path / "sc.json").write_text(json.dumps({"line_rate": 2, "fail": {"77": [1.0, 3]}, "warn_interval_s": 0.5}))
    env = {**os.environ, "ZERORUN_SIM_SCENARIO": str(tmp_path / "sc.json"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "zerorun", "--launcher", "sim", "--hostfile", "hosts", "--log_dir", "logs", "train.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 3, proc.stderr
    assert "launcher sim: --launcher sim" in proc.stderr and "rank node019:77 failed (exit 3)" in proc.stderr
    assert re.search(r"^\[0-\d+.*\] UserWarning: synthetic warning", proc.stderr, re.M)
    assert "160 ranks: 159 signal 15 (SIGTERM) (stopped), 1 exit 3" in proc.stderr
    assert proc.stdout and all(line.startswith("[node000:0]") for line in proc.stdout.splitlines())
    assert len(list((tmp_path / "logs").glob("rank*.log"))) == 160
    assert "simulated cluster" not in proc.stderr  # nothing left behind (printed only otherwise)


def test_a_cut_link_is_a_lost_node_at_once():
    cluster = SimCluster.start(8, Scenario(line_rate=1.0, drop={5: 0.5}))
    try:
        plan, runners = prepare(sim_plan(8, 4), cluster)
        t0 = time.monotonic()
        result = Supervisor(plan, runners, PlainConsole(out=io.StringIO(), err=io.StringIO()), grace_period=1.0).run()
        wall = time.monotonic() - t0
    finally:
        totals = cluster.close()
    assert result.exit_code == 255 and "sim-0005" in result.message and "closed" in result.message
    assert wall < 0.5 + 1.0 + 3.0  # no heartbeat timeout to wait for: EOF says it at once
    assert {s.rank for s in result.ranks if s.state == "lost"} == set(range(20, 24))
    assert totals["ranks_left"] == 0 and totals["agents_left"] == 0
