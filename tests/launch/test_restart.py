"""Restarts (launch/restart.py) and preemption through the real launcher: CPU ranks on gloo.

The classification is a pure function, tested case by case; the real launches are shared:
one uninterrupted 4-rank stage-2 run is the reference for both the kill -9 restart and the
preempted-then-resumed run (same data order, same losses, same final fp32 masters).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from _launch import REPO, SCRIPTS, kill_tagged, run, start, wait_until_gone

from zerorun.launch.plan import LaunchOptions, RankSpec, Target
from zerorun.launch.restart import (
    Attempt,
    budget_message,
    classify,
    failed_nodes,
    run_with_restarts,
    without_nodes,
)
from zerorun.launch.result import PREEMPTED_EXIT_CODE, JobResult, RankState

sys.path.insert(0, str(REPO / "tests"))
from _ranks import run_ranks  # noqa: E402
from runtime.checkpoint._ft_job import ft_config, ft_losses  # noqa: E402

WORKER = REPO / "tests" / "runtime" / "checkpoint" / "_ft_worker.py"
RESTART_JOB = SCRIPTS / "restart_job.py"
STEPS = 8


# --- classification (pure) ---------------------------------------------------------------


def _result(reason: str, code: int, ranks: list[dict], first: int | None = 0, message: str = "") -> JobResult:
    states = []
    for r, spec in enumerate(ranks):
        st = RankState(RankSpec(r, r, 0, "localhost", None))
        st.returncode = spec.get("rc")
        st.state = spec.get("state", "failed")
        st.error = spec.get("error")
        st.status = spec.get("status")
        states.append(st)
    return JobResult(exit_code=code, reason=reason, ranks=states, wall_s=1.0, first_failure=first, message=message)  # type: ignore[arg-type]


SETUP = {"type": "ValueError", "message": "learning rate 'fast' is not a number"}


@pytest.mark.parametrize(
    ("result", "retry", "words"),
    [
        (_result("ok", 0, [{"rc": 0, "state": "exited"}]), False, "finished"),
        (_result("rank_failed", 137, [{"rc": -9}, {"rc": -15, "state": "stopped"}]), True, "SIGKILL"),
        (_result("node_lost", 255, [{"rc": None, "state": "lost"}], message="node w2 was lost"), True, "lost node"),
        (_result("hang", 124, [{"rc": -9, "state": "stopped"}], first=None, message="no progress"), True, "hang"),
        (_result("interrupted", 130, [{"rc": -2, "state": "stopped"}]), False, "interrupted"),
        (_result("preempted", PREEMPTED_EXIT_CODE, [{"rc": PREEMPTED_EXIT_CODE, "state": "exited"}]), False, "preempted"),
        # the same exception on every rank that reported one, the others stopped, no step yet
        (_result("rank_failed", 1, [{"rc": 1, "error": SETUP}, {"rc": -15, "state": "stopped"}]), False, "setup"),
        (_result("rank_failed", 1, [{"rc": 1, "error": SETUP}, {"rc": 1, "error": SETUP}]), False, "not retried"),
        # ... but after the first optimizer step, or different on two ranks: retried
        (_result("rank_failed", 1, [{"rc": 1, "error": SETUP, "status": {"step": 3}}, {"rc": -15, "state": "stopped"}]), True, "failed"),
        (_result("rank_failed", 1, [{"rc": 1, "error": SETUP}, {"rc": 1, "error": {"type": "KeyError", "message": "x"}}]), True, "failed"),
        # a collective that lost its peer is the consequence of a failure elsewhere
        (_result("rank_failed", 1, [{"rc": 1, "error": {"type": "RuntimeError", "message": "Connection closed by peer"}}]), True, "communication"),
    ],
)
def test_classify(result: JobResult, retry: bool, words: str) -> None:
    got, why = classify(result)
    assert got == retry, why
    assert words in why


def test_restart_on_any_failure_retries_a_setup_error() -> None:
    res = _result("rank_failed", 1, [{"rc": 1, "error": SETUP}, {"rc": 1, "error": SETUP}])
    retry, why = classify(res, restart_on_any_failure=True)
    assert retry and "--restart_on_any_failure" in why


def test_budget_message_names_every_attempt() -> None:
    attempts = [Attempt(1, 137, "rank_failed", "", True, "rank 2 was killed (signal 9)", None),
                Attempt(2, 124, "hang", "", True, "hang: no progress", None)]
    text = budget_message(attempts, 1)
    assert "restart budget of 1 exhausted" in text
    assert "attempt 1: rank 2 was killed (signal 9)" in text and "attempt 2: hang: no progress" in text


def _on_hosts(reason: str, code: int, states: list[tuple[str, str, int | None]]) -> JobResult:
    ranks = []
    for r, (host, state, rc) in enumerate(states):
        st = RankState(RankSpec(r, 0, r, host, None))
        st.state, st.returncode = state, rc  # type: ignore[assignment]
        ranks.append(st)
    first = next((r for r, (_, state, _) in enumerate(states) if state == "failed"), None)
    return JobResult(exit_code=code, reason=reason, ranks=ranks, wall_s=1.0, first_failure=first, message="x")  # type: ignore[arg-type]


def test_failed_nodes_and_the_selection_without_them() -> None:
    lost = _on_hosts("node_lost", 255, [("n1", "stopped", -15), ("n2", "lost", None)])
    killed = _on_hosts("rank_failed", 137, [("n1", "failed", -9), ("n2", "stopped", -15)])
    raised = _on_hosts("rank_failed", 1, [("n1", "failed", 1), ("n2", "stopped", -15)])
    assert failed_nodes(lost) == ["n2"] and failed_nodes(killed) == ["n1"] and failed_nodes(raised) == []
    base = LaunchOptions(target=Target(script="t.py"), hostfile="hosts")
    assert without_nodes(base, ["n2"]).exclude == "n2"
    assert without_nodes(replace(base, exclude="n3"), ["n2"]).exclude == "n3@n2"
    assert without_nodes(replace(base, include="n1:0,1@n2@n3"), ["n2"]).include == "n1:0,1@n3"


def test_restart_loop_leaves_failed_nodes_out_until_min_nodes(tmp_path: Path) -> None:
    """The loop alone, with a stand-in for run_job: attempt 1 loses n2, attempt 2 runs without
    it and loses n1; with --min_nodes 1 the loop stops there (no node would be left)."""
    seen: list[LaunchOptions] = []
    results = [
        _on_hosts("node_lost", 255, [("n1", "stopped", -15), ("n2", "lost", None), ("n3", "stopped", -15)]),
        _on_hosts("rank_failed", 137, [("n1", "failed", -9), ("n3", "stopped", -15)]),
        _on_hosts("rank_failed", 137, [("n3", "failed", -9)]),
    ]

    def fake_run_job(options: LaunchOptions) -> JobResult:
        seen.append(options)
        return results[len(seen) - 1]

    opts = LaunchOptions(
        target=Target(script="t.py"), hostfile="hosts", max_restarts=5, exclude_failed_nodes=True, min_nodes=1,
        log_dir=str(tmp_path),
    )
    code = run_with_restarts(opts, run_job=fake_run_job, port_is_free=lambda _p: True)
    assert code == 137
    assert [o.exclude for o in seen] == [None, "n2", "n2@n1"]
    assert [o.log_dir for o in seen] == [str(tmp_path / f"attempt{k}") for k in (1, 2, 3)]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [a["retryable"] for a in summary["attempts"]] == [True, True, False]
    assert "leaving out n3 (0 node(s) left), fewer than --min_nodes 1" in summary["attempts"][-1]["why"]


def test_preempted_exit_code_is_the_runtimes() -> None:
    from zerorun.runtime.checkpoint.options import PREEMPTED_EXIT_CODE as runtime_code

    assert runtime_code == PREEMPTED_EXIT_CODE


# --- real launches without torch ----------------------------------------------------------


def test_setup_error_is_not_restarted(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    code, out, err, tag = run(
        ["--num_gpus", "2", "--max_restarts", "2", "--log_dir", str(logs), str(RESTART_JOB)],
        env={"RJ_MODE": "setup_error"},
    )
    assert code == 1, err
    assert not wait_until_gone(tag, 5)
    assert "attempt 1/3" in err and "attempt 2/3" not in err
    assert "not retried" in err and "learning rate 'fast' is not a number" in err
    summary = json.loads((logs / "summary.json").read_text())
    assert [a["attempt"] for a in summary["attempts"]] == [1]
    assert summary["exit_code"] == 1 and summary["attempts"][0]["retryable"] is False
    assert (logs / "attempt1" / "summary.json").is_file() and not (logs / "attempt2").exists()


def test_restart_budget_exhausted_names_every_attempt(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    code, out, err, tag = run(
        ["--num_gpus", "2", "--max_restarts", "1", "--grace_period", "1", "--log_dir", str(logs), str(RESTART_JOB)],
        env={"RJ_MODE": "kill"},
    )
    assert code == 137, err  # the last attempt's: rank 1 killed by signal 9
    assert not wait_until_gone(tag, 5)
    assert "attempt 1/2" in err and "attempt 2/2 (restart)" in err
    assert "restart budget of 1 exhausted" in err
    assert "attempt 1: rank 1 was killed (signal 9 (SIGKILL)" in err and "attempt 2: rank 1 was killed" in err
    summary = json.loads((logs / "summary.json").read_text())
    assert [(a["attempt"], a["exit_code"], a["retryable"]) for a in summary["attempts"]] == [(1, 137, True), (2, 137, True)]
    runs = {json.loads((logs / f"attempt{k}" / "summary.json").read_text())["run_id"] for k in (1, 2)}
    assert len(runs) == 2  # a new run id per attempt


def test_a_restart_that_cannot_start_is_a_failed_attempt_and_the_loop_goes_on(tmp_path: Path) -> None:
    """Attempt 1's rank 1 deletes the script and dies; attempts 2 and 3 fail their checks before
    any rank starts (script not found). Each is recorded with its own reason and exit code, the
    loop retries until the budget is spent (before: it stopped at attempt 2, and summary.json
    gave attempt 1's exit code), and the job exits with the last attempt's code, the error's."""
    import shutil

    script = tmp_path / "job.py"
    shutil.copy(RESTART_JOB, script)
    logs = tmp_path / "logs"
    code, _out, err, tag = run(
        ["--num_gpus", "2", "--max_restarts", "2", "--grace_period", "1", "--log_dir", str(logs), str(script)],
        env={"RJ_MODE": "vanish", "ZERORUN_RESTART_WAIT": "0"},
    )
    assert not wait_until_gone(tag, 5)
    assert code == 1, err
    assert f"attempt 2/3 could not start: script {script} not found (working directory" in err, err
    assert "); restarting in 0 s" in err, err
    assert "attempt 3/3 (restart)" in err and "restart budget of 2 exhausted" in err, err
    summary = json.loads((logs / "summary.json").read_text())
    got = [(a["attempt"], a["exit_code"], a["reason"], a["retryable"]) for a in summary["attempts"]]
    assert got == [(1, 137, "rank_failed", True), (2, 1, "not_started", True), (3, 1, "not_started", True)], got
    assert "not found" in summary["attempts"][2]["message"] and summary["exit_code"] == 1


def test_start_failures_that_would_repeat_are_not_retried(tmp_path: Path) -> None:
    from zerorun.errors import ConfigError, HostfileError, LaunchError
    from zerorun.launch.restart import classify_start_failure

    assert classify_start_failure(LaunchError("node2: connection refused"), restart=True)[0] is True
    assert classify_start_failure(LaunchError("node2: connection refused"), restart=False)[0] is False
    assert classify_start_failure(HostfileError("only 1 node left, --num_nodes 2"), restart=True)[0] is False
    assert classify_start_failure(ConfigError("bad key"), restart=True)[0] is False

    # The loop with a stand-in run_job: restarts that cannot start wait 10, 20, 40 s ... (a node
    # may be rebooting), then a config error on a restart ends it, with that code.
    calls: list[int] = []
    waits: list[float] = []

    def fake_run_job(options: LaunchOptions) -> JobResult:
        calls.append(1)
        if len(calls) == 1:
            return _result("rank_failed", 137, [{"rc": -9}], first=0)
        if len(calls) < 5:
            raise LaunchError("node2: connection refused")
        raise ConfigError("ds.json: zero_optimization.stage 7 does not exist")

    opts = LaunchOptions(target=Target(script="t.py"), max_restarts=5, log_dir=str(tmp_path))
    with pytest.raises(ConfigError):
        run_with_restarts(opts, run_job=fake_run_job, port_is_free=lambda _p: True, sleep=waits.append)
    assert len(calls) == 5 and waits == [10.0, 20.0, 40.0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(a["exit_code"], a["retryable"]) for a in summary["attempts"]] == [(137, True)] + [(1, True)] * 3 + [(1, False)]
    assert summary["exit_code"] == 1


def test_ctrl_c_while_waiting_to_restart_stops_with_130(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C during the wait before retrying an attempt that could not start: the loop ends there
    with 130 and says so (it escaped to the CLI, which said "interrupted before the job started"
    after an attempt had run), and summary.json keeps the attempts with that exit code."""
    from zerorun.errors import LaunchError

    calls: list[int] = []

    def fake_run_job(options: LaunchOptions) -> JobResult:
        calls.append(1)
        if len(calls) == 1:
            return _result("rank_failed", 137, [{"rc": -9}], first=0)
        raise LaunchError("node2: connection refused")

    def interrupted(_seconds: float) -> None:
        raise KeyboardInterrupt

    opts = LaunchOptions(target=Target(script="t.py"), max_restarts=3, log_dir=str(tmp_path))
    code = run_with_restarts(opts, run_job=fake_run_job, port_is_free=lambda _p: True, sleep=interrupted)
    assert code == 130 and len(calls) == 2
    assert "interrupted while waiting to restart; attempt 3/4 not started" in capsys.readouterr().err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [a["reason"] for a in summary["attempts"]] == ["rank_failed", "not_started"] and summary["exit_code"] == 130


def _wait_for(path_lines: list[tuple[Path, str]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.exists() and text in p.read_text() for p, text in path_lines):
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {path_lines}")


def test_launcher_sigterm_with_save_on_preemption_waits_for_the_save(tmp_path: Path) -> None:
    """The launcher's side alone: SIGTERM goes to the ranks (not their process groups), which
    report `preempted` and exit 75; the launcher exits 75 and says which checkpoint."""
    logs = tmp_path / "logs"
    launch = start(
        ["--num_gpus", "2", "--save_on_preemption", "--log_dir", str(logs), str(RESTART_JOB)], env={"RJ_MODE": "preempt"}
    )
    try:
        _wait_for([(logs / "rank0.log", "ready"), (logs / "rank1.log", "ready")], 60)
        os.kill(launch.proc.pid, signal.SIGTERM)
        code, _out, err = launch.finish(60)
    finally:
        kill_tagged(launch.tag)
    assert code == PREEMPTED_EXIT_CODE, err
    assert "--save_on_preemption" in err and "25 s before SIGKILL" in err
    assert "preempted; checkpoint global_step3 saved in /ckpt" in err
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["reason"] == "preempted" and summary["exit_code"] == PREEMPTED_EXIT_CODE
    assert [r["returncode"] for r in summary["ranks"]] == [PREEMPTED_EXIT_CODE] * 2


def test_per_node_mode_every_node_restarts_and_they_meet_again(tmp_path: Path) -> None:
    """One zerorun per node (--nnodes/--node_rank; two on this machine): the killed rank's node
    and the stopped node both restart, and the second attempt meets at the rendezvous again."""
    from _ranks import free_port

    port = free_port()
    launches = [
        start(
            ["--nnodes", "2", "--node_rank", str(n), "--master_addr", "127.0.0.1", "--master_port", str(port),
             "--num_gpus", "1", "--device", "cpu", "--max_restarts", "1", "--grace_period", "1",
             "--log_dir", str(tmp_path / f"node{n}"), str(RESTART_JOB)],
            env={"RJ_MODE": "kill"},
        )
        for n in (0, 1)
    ]
    try:
        results = [launch.finish(90) for launch in launches]
    finally:
        for launch in launches:
            kill_tagged(launch.tag)
    for n, (code, _out, err) in enumerate(results):
        assert code == 137, err
        assert "attempt 2/2 (restart)" in err and "restart budget of 1 exhausted" in err, err
        summary = json.loads((tmp_path / f"node{n}" / "summary.json").read_text())
        assert [a["exit_code"] for a in summary["attempts"]] == [137, 137]
        # both attempts had the whole job: 2 ranks, one per node
        for k in (1, 2):
            ranks = json.loads((tmp_path / f"node{n}" / f"attempt{k}" / "summary.json").read_text())["ranks"]
            assert len(ranks) == 2
    assert not any(wait_until_gone(launch.tag, 5) for launch in launches)


# --- real training jobs: kill -9 + restart + auto-resume, preemption ----------------------


def _masters(out: Path) -> dict:
    from zerorun.runtime.checkpoint import get_fp32_state_dict

    return get_fp32_state_dict(out / "final")


def _job(tmp: Path, name: str) -> tuple[Path, dict[str, str]]:
    out = tmp / name
    out.mkdir()
    env = {"FT_CONFIG": json.dumps(ft_config(out / "ckpt")), "FT_OUT": str(out), "FT_STEPS": str(STEPS)}
    (out / "config.json").write_text(env["FT_CONFIG"])
    return out, env


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run: 4 ranks, stage 2, 8 steps (the data loader passes its end at step 5)."""
    out, env = _job(tmp_path_factory.mktemp("ref"), "ref")
    results = run_ranks([str(WORKER)], 4, deadline_s=180, extra_env=env)
    assert [rc for rc, _ in results] == [0] * 4, results[0][1][-3000:]
    return out


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        diff = (a[k] - b[k]).abs().max().item()
        scale = b[k].abs().max().item()
        assert diff <= 1e-6 * scale, (k, diff, scale)


def test_kill9_restart_resumes_and_matches_the_uninterrupted_run(tmp_path: Path, reference: Path) -> None:
    out, env = _job(tmp_path, "kill")
    logs = tmp_path / "logs"
    code, _stdout, err, tag = run(
        ["--num_gpus", "4", "--max_restarts", "2", "--grace_period", "2", "--log_dir", str(logs), str(WORKER)],
        env={**env, "FT_KILL": "2:7"},
        timeout=300,
    )
    assert code == 0, err[-4000:]
    assert not wait_until_gone(tag, 5)
    assert (out / "killed").read_text() == "7"
    summary = json.loads((logs / "summary.json").read_text())
    assert [(a["attempt"], a["exit_code"]) for a in summary["attempts"]] == [(1, 137), (2, 0)]
    assert "rank 2 was killed" in summary["attempts"][0]["why"]
    assert "attempt 2/3 (restart)" in err
    # attempt 2 resumed from the last periodic save before the kill (step 6) and replayed step 7
    rows = [json.loads(x) for x in (out / "losses_rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 7, 8]
    assert rows[-1]["resumed_from"].endswith("ckpt/global_step6")
    assert ft_losses(out) == ft_losses(reference)
    _close(_masters(out), _masters(reference))


def test_sigterm_with_save_on_preemption_saves_exits_75_and_resumes(tmp_path: Path, reference: Path) -> None:
    out, env = _job(tmp_path, "preempt")
    logs = tmp_path / "logs"
    args = ["--num_gpus", "4", "--save_on_preemption", "--log_dir", str(logs), str(WORKER)]
    launch = start(args, env={**env, "FT_SLOW": "0.25"})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            f = out / "losses_rank0.jsonl"
            if f.exists() and len(f.read_text().splitlines()) >= 2:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the job did not reach step 2")
        # Like Slurm signalling the processes of a step: SIGTERM to one rank only. The ranks
        # agree at a step boundary that one of them was signalled, and all save that step.
        os.kill(int((out / "pid_rank1").read_text()), signal.SIGTERM)
        code, _stdout, err = launch.finish(120)
    finally:
        kill_tagged(launch.tag)
    assert code == PREEMPTED_EXIT_CODE, err[-4000:]
    saved = (out / "ckpt" / "latest").read_text()
    step = int(saved.removeprefix("global_step"))
    assert 2 <= step < STEPS
    assert f"preempted; checkpoint {saved} saved" in err
    assert "rank 1 got SIGTERM" in err
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["reason"] == "preempted" and summary["exit_code"] == PREEMPTED_EXIT_CODE
    assert not (out / "final").exists()

    # The next submission resumes from that checkpoint and finishes: named with --resume_from
    # (a tag directory; it wins over the config's auto_resume for loading).
    code, _stdout, err, tag = run(
        ["--num_gpus", "4", "--resume_from", str(out / "ckpt" / saved), str(WORKER)], env=env, timeout=180
    )
    assert code == 0, err[-4000:]
    assert f"resumed from {out / 'ckpt' / saved} at step {step}" in err
    # Every step's loss equals the uninterrupted run's; the preempted step's loss was never
    # logged (engine.step() saved and exited before the script saw it).
    got, ref = ft_losses(out), ft_losses(reference)
    assert sorted(got) == [s for s in range(1, STEPS + 1) if s != step]
    assert all(got[s] == ref[s] for s in got)
    _close(_masters(out), _masters(reference))


def test_a_restart_on_fewer_ranks_re_resolves_the_batch_and_says_what_changed(tmp_path: Path) -> None:
    """Two "nodes" on this machine (localhost: 2 ranks, 127.0.0.1: 1 rank; both local, real
    processes), train_batch_size 6 with micro 2. Rank 2 (on 127.0.0.1) is SIGKILLed after step 3;
    --exclude_failed_nodes leaves that node out, and attempt 2 runs 2 ranks, where 6 is not a
    multiple of micro 2 x 2 ranks: the launcher re-resolves the triad (train_batch_size 4, before:
    a config error and the loop stopped), says so, the ranks train with it (ZERORUN_BATCH), resume
    from step 2 and finish."""
    out = tmp_path / "out"
    out.mkdir()
    config = {**ft_config(out / "ckpt"), "train_batch_size": 6}  # micro 2 (accumulation derived)
    del config["gradient_accumulation_steps"]
    (tmp_path / "ds.json").write_text(json.dumps(config))
    (tmp_path / "hosts").write_text("localhost slots=2\n127.0.0.1 slots=1\n")
    logs = tmp_path / "logs"
    env = {"FT_CONFIG": json.dumps(config), "FT_OUT": str(out), "FT_STEPS": "6", "FT_KILL": "2:3"}
    code, _stdout, err, tag = run(
        ["--hostfile", str(tmp_path / "hosts"), "--device", "cpu", "--max_restarts", "1", "--exclude_failed_nodes",
         "--grace_period", "2", "--log_dir", str(logs), "--config", str(tmp_path / "ds.json"), str(WORKER)],
        env=env, timeout=300,
    )  # fmt: skip
    assert code == 0, err[-4000:]
    assert not wait_until_gone(tag, 5)
    message = (
        "world size 3 -> 2: train_batch_size 6 is not a multiple of micro 2 × 2 ranks = 4, so it changes: "
        "train_batch_size 6 -> 4 = micro 2 × accum 1 × 2 ranks (was micro 2 × accum 1 × 3 ranks)"
    )
    assert message in err, err[-4000:]
    summary = json.loads((logs / "summary.json").read_text())
    got = [(a["attempt"], a["exit_code"], a["world_size"]) for a in summary["attempts"]]
    assert got == [(1, 137, 3), (2, 0, 2)], summary
    assert "leaving out 127.0.0.1 (1 node(s) left)" in summary["attempts"][0]["why"]
    assert summary["attempts"][0]["batch"] is None and message in summary["attempts"][1]["batch"]
    rows = [json.loads(x) for x in (out / "losses_rank0.jsonl").read_text().splitlines()]
    assert [(r["step"], r["world"], r["train_batch"]) for r in rows] == [
        (1, 3, 6), (2, 3, 6), (3, 3, 6), (3, 2, 4), (4, 2, 4), (5, 2, 4), (6, 2, 4)
    ]  # fmt: skip
    assert rows[3]["resumed_from"].endswith("ckpt/global_step2")


def test_a_hostfile_and_include_from_the_config_are_what_failed_nodes_leave(tmp_path: Path) -> None:
    """`launcher: {hostfile, include, exclude_failed_nodes}` in the config alone (before: the
    loop saw no hostfile and refused --exclude_failed_nodes, and it would have put the failed
    node in an `exclude` beside the config's `include`)."""
    (tmp_path / "hosts").write_text("n1 slots=1\nn2 slots=1\nn3 slots=1\n")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1,
        "launcher": {"hostfile": "hosts", "include": "n1@n2", "exclude_failed_nodes": True, "max_restarts": 1},
    }))  # fmt: skip
    seen: list[LaunchOptions] = []
    results = [
        _on_hosts("node_lost", 255, [("n1", "stopped", -15), ("n2", "lost", None)]),
        _on_hosts("ok", 0, [("n1", "exited", 0)]),
    ]

    def fake_run_job(options: LaunchOptions) -> JobResult:
        seen.append(options)
        return results[len(seen) - 1]

    opts = LaunchOptions(target=Target(script="t.py"), config=str(config))
    assert run_with_restarts(opts, run_job=fake_run_job, port_is_free=lambda _p: True) == 0
    assert [o.include for o in seen] == ["n1@n2", "n1"] and [o.exclude for o in seen] == [None, None]
    assert seen[1].hostfile == str(tmp_path / "hosts")
