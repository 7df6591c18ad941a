"""launch/agent.py: the node agent's preflight answer (addresses, master port, the script)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from zerorun.launch.agent import hello


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


def test_a_storm_of_sigterms_is_handled_off_the_signal_handler(tmp_path: Path) -> None:
    """A real agent with a real rank (--save_on_preemption): 40 SIGTERMs in a burst. The handler
    only writes to a pipe (it used to print and signal ranks inside the handler, where a nested
    signal re-enters the stderr stream it is printing to); the signal thread passes the first
    to the rank once, which saves and exits 75; the agent still answers a preflight after the
    storm, and SIGHUP then kills it with its message."""
    import queue
    import signal
    import subprocess
    import sys
    import threading
    import time

    from _launch import REPO, SCRIPTS, base_env

    from zerorun.launch import wire
    from zerorun.launch.hosts import Host
    from zerorun.launch.plan import DeviceInfo, LaunchOptions, Target, build_plan

    options = LaunchOptions(target=Target(script=str(SCRIPTS / "restart_job.py")), device="cpu", save_on_preemption=True)
    plan = build_plan(
        options, [Host("localhost", (0,))], DeviceInfo(gpus=(), cores=2), master_port=29500, run_id="agent-signals",
        cwd=str(tmp_path),
    )
    env, _tag = base_env({"RJ_MODE": "preempt"})
    agent = subprocess.Popen(
        [sys.executable, "-m", "zerorun.launch.agent"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=env, cwd=REPO,
    )
    messages: queue.Queue[dict] = queue.Queue()

    def read() -> None:
        assert agent.stdout is not None
        for line in agent.stdout:
            msg = wire.decode(line)
            if msg is not None:
                messages.put(msg)

    threading.Thread(target=read, daemon=True).start()

    def wait_for(pred, what: str, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = messages.get(timeout=0.5)
            except queue.Empty:
                assert agent.poll() is None, f"agent exited {agent.returncode} waiting for {what}"
                continue
            if pred(msg):
                return msg
        raise AssertionError(f"timed out waiting for {what}")

    def send(kind: str, **fields) -> None:
        assert agent.stdin is not None
        agent.stdin.write(wire.encode(kind, **fields))
        agent.stdin.flush()

    try:
        send("plan", plan=wire.plan_to_dict(plan, 0), node_rank=0, heartbeat_s=0.5, heartbeat_timeout_s=120)
        wait_for(lambda m: m["t"] == "lines" and any("ready" in run[2] for run in m["runs"]), "the rank's 'ready'")
        for _ in range(40):
            agent.send_signal(signal.SIGTERM)
        exit_msg = wait_for(lambda m: m["t"] == "exit", "the rank's exit")
        assert exit_msg["code"] == 75
        send("preflight", check_port=None)
        wait_for(lambda m: m["t"] == "hello", "the hello after the storm")
        assert agent.poll() is None
        agent.send_signal(signal.SIGHUP)
        agent.wait(timeout=30)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert agent.stderr is not None
    err = agent.stderr.read().decode()
    assert err.count("got SIGTERM; the ranks save and exit (25 s)") == 1, err
    assert "got SIGHUP; killed this node's ranks" in err, err
    assert "Traceback" not in err and "reentrant" not in err, err


def test_an_agent_whose_stderr_is_gone_still_kills_its_ranks_and_exits(tmp_path: Path) -> None:
    """Over SSH the agent's stderr is the connection's: when the connection goes, printing the
    reason raises EPIPE. A real agent and rank, the agent's stderr closed by the reader, then the
    launcher falls silent (stdin left open): the watchdog thread must still kill the rank and end
    the agent with status 3 (it used to raise out of die() on that thread before exiting, leaving
    the agent running for good with its death lock held)."""
    import os
    import subprocess
    import sys
    import time

    from _launch import REPO, base_env

    from zerorun.launch import wire
    from zerorun.launch.hosts import Host
    from zerorun.launch.plan import DeviceInfo, LaunchOptions, Target, build_plan

    pid_file = tmp_path / "rank.pid"
    script = tmp_path / "sleeper.py"
    script.write_text(
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(120)\n"
    )
    options = LaunchOptions(target=Target(script=str(script)), device="cpu")
    plan = build_plan(
        options, [Host("localhost", (0,))], DeviceInfo(gpus=(), cores=2), master_port=29500, run_id="agent-epipe",
        cwd=str(tmp_path),
    )
    env, _tag = base_env()
    agent = subprocess.Popen(
        [sys.executable, "-m", "zerorun.launch.agent"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, env=env, cwd=REPO,
    )
    assert agent.stdin is not None and agent.stderr is not None
    try:
        agent.stdin.write(wire.encode("plan", plan=wire.plan_to_dict(plan, 0), node_rank=0, heartbeat_s=0.2,
                                      heartbeat_timeout_s=2.0))  # fmt: skip
        agent.stdin.flush()
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and agent.poll() is None, "the rank did not start"
            time.sleep(0.05)
        rank_pid = int(pid_file.read_text())
        agent.stderr.close()  # the connection's stderr is gone; no more messages from the launcher
        assert agent.wait(timeout=30) == 3
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{rank_pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        break  # killed; waiting for a reaper
            except FileNotFoundError:
                break
            time.sleep(0.05)
        else:
            os.kill(rank_pid, 9)
            raise AssertionError("the rank outlived its agent")
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
