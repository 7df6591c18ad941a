"""launch/dialin.py with real processes: a stand-in for srun/mpirun starts the real node agent
in --dial mode; a connection without the job's token is turned away, a silent one holds
nothing up."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

from zerorun.launch.dialin import _token_matches, prepare_dialed
from zerorun.launch.hosts import parse_hostfile_text
from zerorun.launch.plan import DeviceInfo, LaunchOptions, Target, build_plan

# What the scheduler's command does here: a stranger connects and says nothing (a port scanner,
# kept open by a process of its own), another dials with a wrong token for the same node (it
# waits until the launcher hangs up on it), then the real agent takes its place.
_STEP = textwrap.dedent(
    """
    import os, socket, subprocess, sys
    hosts, port = os.environ["ZERORUN_AGENT_DIAL"].rsplit(":", 1)
    host = hosts.split(",")[-1]
    silent = subprocess.Popen([sys.executable, "-c",
        f"import socket, sys, time; s = socket.create_connection(({host!r}, {port})); print(1, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE)
    silent.stdout.readline()
    open(sys.argv[1], "w").write(str(silent.pid))
    s = socket.create_connection((host, int(port)))
    s.sendall(b'{"t": "dial", "token": "not-the-token", "node": "n1", "hostname": "x", "pid": 1}\\n')
    s.recv(1)
    os.execv(sys.executable, [sys.executable, "-u", "-m", "zerorun.launch.agent", "--dial"])
    """
)


def test_token_matches() -> None:
    assert _token_matches("ab12", "ab12")
    assert not _token_matches("ab13", "ab12") and not _token_matches(None, "ab12") and not _token_matches(12, "12")


def test_agents_dial_in_a_stranger_is_turned_away_and_close_ends_the_step(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("pass\n")
    step_script = tmp_path / "step.py"
    step_script.write_text(_STEP)
    options = LaunchOptions(target=Target(script="train.py"), device="cpu")
    plan = build_plan(
        options,
        parse_hostfile_text("n1 slots=2\n"),
        DeviceInfo(gpus=(), cores=8),
        master_port=29500,
        run_id="r1",
        cwd=str(tmp_path),
    )
    repo = str(Path(__file__).resolve().parents[2])
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": repo, "SLURMD_NODENAME": "n1", "ZERORUN_AGENT_START_TIMEOUT": "30"}
    t0 = time.monotonic()
    planned, runners = prepare_dialed(
        plan,
        options,
        command=lambda _setup: [sys.executable, str(step_script), str(tmp_path / "silent.pid")],
        node_of=lambda node, names: node if node in names else None,
        environ=env,
    )
    took = time.monotonic() - t0
    os.kill(int((tmp_path / "silent.pid").read_text()), signal.SIGKILL)
    assert len(runners) == 1 and planned.master_port > 0  # the real agent passed the preflight
    assert took < 8.0, took  # not held up by the silent stranger (10 s before it is dropped)
    step = runners[0].step
    assert step.proc.poll() is None
    runners[0].close()  # the last runner closed: the agent's link and the step end
    assert step.proc.wait(timeout=15) is not None
