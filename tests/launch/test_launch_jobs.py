"""Real launches: CPU ranks on gloo, every launch with a deadline and a leftover check.

The expensive part of the launcher's tests: each test here starts real rank processes, so
cases share launches (one job checks prefixes, log files, events, environment and a
torchrun-style script at once). Failures are injected through ZR_MODE (see
scripts/rank_job.py), never by racing timers.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest
from _launch import RANK_JOB, SCRIPTS, describe, kill_tagged, run, start, wait_until_gone


def _summary(log_dir: Path) -> dict:
    return json.loads((log_dir / "summary.json").read_text())


def test_four_ranks_collectives_prefixes_logs_events(tmp_path: Path) -> None:
    """A torchrun-style script (it calls init_process_group itself) on 4 ranks: all_reduce
    and all_gather give the right numbers; every line carries its rank prefix; each rank has
    its own log file; events (status, memory with the registered breakdown) are recorded."""
    logs = tmp_path / "logs"
    code, out, err, tag = run(
        ["--num_gpus", "4", "--log_dir", str(logs), str(RANK_JOB)],
        env={"ZR_MODE": "collectives", "ZERORUN_MEMORY_REPORT_INTERVAL": "0.5"},
        timeout=150,
    )
    assert code == 0, err
    assert not wait_until_gone(tag, 5)
    for r in range(4):
        # 4 ranks on (at least) 2 cores; the launcher only sets OMP_NUM_THREADS when unset,
        # and the test environment sets 1.
        assert f"[{r}] allreduce ok 10 rank={r} local={r} omp=1" in out
        assert f"[{r}] stderr line from {r}" in err
        log = (logs / f"rank{r}.log").read_text()
        assert f"allreduce ok 10 rank={r}" in log and f"stderr line from {r}" in log
        assert f"rank={(r + 1) % 4}" not in log
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert all(ln.startswith(("[0] ", "[1] ", "[2] ", "[3] ")) for ln in lines), out
    run_ids = {ln.rsplit("run=", 1)[1] for ln in lines if "run=" in ln}
    assert len(run_ids) == 1

    events = [json.loads(ln) for ln in (logs / "events.jsonl").read_text().splitlines()]
    status = {e["rank"]: e for e in events if e["kind"] == "status"}
    assert {r: status[r]["step"] for r in range(4)} == {r: 7 for r in range(4)}
    finals = {e["rank"]: e for e in events if e["kind"] == "memory" and e.get("final")}
    assert sorted(finals) == [0, 1, 2, 3]
    for r, ev in finals.items():
        assert ev["rss"] > 10 * 2**20 and ev["rss_peak"] >= ev["rss"]
        assert ev["breakdown"] == {"params": 1000 * (r + 1), "cpu": {"optimizer_states": 8000}}
        assert "gpu" not in ev  # CPU job: torch is imported but CUDA never initialised

    summary = _summary(logs)
    assert summary["exit_code"] == 0 and summary["reason"] == "ok"
    assert [r["exit"] for r in summary["ranks"]] == ["exit 0"] * 4
    assert all(r["rss_peak"] > 10 * 2**20 for r in summary["ranks"])
    # The console's end summary shows the measured breakdown by component.
    assert "memory by component" in err and "cpu.optimizer_states" in err


def test_rank_exit_3_stops_the_others(tmp_path: Path) -> None:
    """Rank 1 exits 3 after a real all_reduce while rank 0 waits in the next collective:
    rank 0 is stopped within seconds, the launcher exits 3 and names rank 1."""
    logs = tmp_path / "logs"
    code, out, err, tag = run(
        ["--num-gpus", "2", "--grace_period", "2", "--log-dir", str(logs), str(RANK_JOB)],
        env={"ZR_MODE": "fail_fast"},
        timeout=120,
    )
    assert code == 3, err
    assert not wait_until_gone(tag, 5), describe(wait_until_gone(tag, 0))
    assert "[0] rank 0 passed the first all_reduce (2)" in out
    assert "rank 1 failed first" in err and "rank 1 on localhost" in err and "exit 3" in err
    assert "rank 1 is failing on purpose" in err.split("FAILED", 1)[1]  # last stderr lines in the panel
    summary = _summary(logs)
    assert summary["first_failure"] == 1 and summary["reason"] == "rank_failed"
    r0, r1 = summary["ranks"]
    assert r1["exit"] == "exit 3" and r1["state"] == "failed"
    assert r0["state"] == "stopped"
    # Rank 0 did not outlive rank 1 by more than the grace period (+ slack for a busy box).
    assert r0["wall_s"] - r1["wall_s"] < 2 + 3


def test_sigkilled_rank_is_decoded_and_exception_reported(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    code, _out, err, tag = run(
        ["--num_gpus", "3", "--log_dir", str(logs), str(RANK_JOB)],
        env={"ZR_MODE": "sigkill", "ZR_RANK": "2"},
        timeout=60,
    )
    assert code == 128 + 9
    assert not wait_until_gone(tag, 5)
    assert "signal 9 (SIGKILL): likely the OOM killer" in err
    summary = _summary(logs)
    assert summary["first_failure"] == 2
    assert summary["ranks"][2]["exit"].startswith("signal 9 (SIGKILL)")

    # An uncaught exception: exit 1 as with `python`, a clean traceback (no shim frames), an
    # error event, and the exception named in the failure panel.
    logs = tmp_path / "logs2"
    code, _out, err, tag = run(["--num_gpus", "2", "--log_dir", str(logs), str(RANK_JOB)], env={"ZR_MODE": "raise"})
    assert code == 1
    assert not wait_until_gone(tag, 5)
    assert "[0] ValueError: broken on purpose" in err
    assert "shim.py" not in err and "runpy" not in err
    assert "exception: ValueError: broken on purpose" in err
    errors = [json.loads(ln) for ln in (logs / "events.jsonl").read_text().splitlines() if '"error"' in ln]
    assert errors[0]["rank"] == 0 and errors[0]["type"] == "ValueError"


def _wait_for_lines(launch, needles: list[str], timeout: float) -> str:
    """Read the launcher's stdout until every needle was seen (a thread keeps reading)."""
    seen: list[str] = []
    done = threading.Event()

    def reader() -> None:
        for line in launch.proc.stdout:
            seen.append(line)
            if all(any(n in s for s in seen) for n in needles):
                done.set()
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    done.wait(timeout)
    text = "".join(seen)
    assert all(n in text for n in needles), text
    return text


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_launcher_signal_leaves_no_process(sig: int) -> None:
    """Each rank starts a child in its group and one that escapes with setsid. Ctrl-C or
    SIGTERM to the launcher, or SIGKILL of the launcher itself: no process of the job survives."""
    launch = start(["--num_gpus", "2", str(RANK_JOB)], env={"ZR_MODE": "children"})
    try:
        _wait_for_lines(launch, ["ready 0", "ready 1"], timeout=60)
        # launcher + 2 ranks + 2 sentinels + 4 children
        assert len(wait_until_gone(launch.tag, 0)) >= 9
        t0 = time.monotonic()
        launch.proc.send_signal(sig)
        launch.proc.wait(timeout=30)
        left = wait_until_gone(launch.tag, 10)
        assert not left, describe(left)
        assert time.monotonic() - t0 < 8
        assert launch.proc.returncode == (-9 if sig == signal.SIGKILL else 128 + sig)
    finally:
        kill_tagged(launch.tag)
        launch.proc.kill()
        launch.proc.communicate(timeout=10)


def test_hang_timeout_dumps_stacks_and_names_the_rank_behind(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    code, _out, err, tag = run(
        ["--num_gpus", "2", "--hang_timeout", "3", "--grace_period", "1", "--log_dir", str(logs), str(RANK_JOB)],
        # periodic memory events keep coming: they must not hide the hang
        env={"ZR_MODE": "hang", "ZERORUN_MEMORY_REPORT_INTERVAL": "0.3"},
        timeout=60,
    )
    assert code == 124, err
    assert not wait_until_gone(tag, 5)
    assert "rank 0: rank_job.py" in err and "in stuck_in_a_function_named_wait_forever (last step 5)" in err
    assert "rank 1: rank_job.py" in err and "in slow_rank_stuck_here (last step 3)" in err
    assert "behind: rank(s) 1" in err
    # the full dumps are in the rank logs
    assert "in slow_rank_stuck_here" in (logs / "rank1.log").read_text()
    assert "Current thread" in (logs / "rank0.log").read_text()
    assert _summary(logs)["reason"] == "hang"


def test_module_argv_and_console_filter(tmp_path: Path) -> None:
    """`-m module` runs like python -m; script arguments that look like launcher options
    pass through untouched; `--ranks 1` shows only rank 1 but every rank's log is written."""
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        "import os, sys\nprint('mod', os.environ['RANK'], __name__, sys.argv[1:], sys.path[0] == os.getcwd(),\n"
        "      os.environ.get('FOO_T'), 'torch' in sys.modules)\n"
    )
    logs = tmp_path / "logs"
    code, out, err, _ = run(
        ["--ranks", "1", "--env", "FOO_T=a b=c", "--log_dir", str(logs), "-m", "mypkg.train", "--num_gpus", "7",
         "--config", "x"],
        cwd=tmp_path,
    )
    assert code == 0, err
    # --env arrives verbatim; a CPU rank has not paid for importing torch
    assert out.strip() == "[1] mod 1 __main__ ['--num_gpus', '7', '--config', 'x'] True a b=c False"
    assert "mod 0 __main__" in (logs / "rank0.log").read_text()

    code, out, err, _ = run(["--num_gpus", "1", str(SCRIPTS / "rank_job.py"), "a b", "--num_gpus=9"], env={"ZR_MODE": "hello"})
    assert code == 0, err
    assert out.strip() == "[0] hello 0/1 argv=['a b', '--num_gpus=9'] name=__main__"


def test_closed_console_does_not_stop_the_job(tmp_path: Path) -> None:
    """`zerorun ... | head`: the launcher's stdout goes away; the job still runs to the end and
    its log files are complete."""
    logs = tmp_path / "logs"
    launch = start(["--num_gpus", "2", "--log_dir", str(logs), str(RANK_JOB)], env={"ZR_MODE": "many"})
    try:
        assert launch.proc.stdout.readline().startswith("[")
        launch.proc.stdout.close()
        launch.proc.wait(timeout=60)
        assert launch.proc.returncode == 0, launch.proc.stderr.read()
        for r in range(2):
            assert (logs / f"rank{r}.log").read_text().count("\n") == 20000
    finally:
        kill_tagged(launch.tag)
        launch.proc.kill()
        launch.proc.wait(timeout=10)


def test_deepspeed_style_script_gets_local_rank(tmp_path: Path) -> None:
    """A script that declares --local_rank (DeepSpeed's launcher always passes it) gets it;
    `--no_local_rank` turns that off, as in DeepSpeed."""
    script = tmp_path / "ds_train.py"
    script.write_text(
        "import argparse\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('--local_rank', type=int, default=-1)\n"
        "p.add_argument('--deepspeed_config')\n"
        "a = p.parse_args()\n"
        "print('local_rank', a.local_rank)\n"
    )
    code, out, err, _ = run(["--num_gpus", "2", str(script)])
    assert code == 0, err
    assert sorted(out.splitlines()) == ["[0] local_rank 0", "[1] local_rank 1"]
    code, out, err, _ = run(["--num_gpus", "1", "--no_local_rank", str(script)])
    assert code == 0, err
    assert out.strip() == "[0] local_rank -1"


def test_ranks_ignoring_sigterm_are_killed_after_the_grace_period(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    launch = start(["--num_gpus", "2", "--grace_period", "1", "--log_dir", str(logs), str(RANK_JOB)], env={"ZR_MODE": "ignore_term"})
    try:
        _wait_for_lines(launch, ["ready 0", "ready 1"], timeout=60)
        t0 = time.monotonic()
        launch.proc.send_signal(signal.SIGTERM)
        _out, err = launch.proc.communicate(timeout=30)
        assert launch.proc.returncode == 143
        assert 1.0 <= time.monotonic() - t0 < 8
        assert "grace period of 1 s is over; killing rank(s) 0, 1" in err
        assert not wait_until_gone(launch.tag, 5)
        summary = _summary(logs)
        assert summary["reason"] == "interrupted"
        assert [r["exit"].split(":")[0] for r in summary["ranks"]] == ["signal 9 (SIGKILL)"] * 2
    finally:
        kill_tagged(launch.tag)
        launch.proc.kill()
        launch.proc.wait(timeout=10)


def test_children_left_by_a_finished_rank_are_removed(tmp_path: Path) -> None:
    code, out, err, tag = run(
        ["--num_gpus", "2", str(RANK_JOB)], env={"ZR_MODE": "orphan", "ZR_PID_FILE": str(tmp_path / "pid")}
    )
    assert code == 0, err
    assert "[0] orphan gone" in out
    assert not wait_until_gone(tag, 5)
