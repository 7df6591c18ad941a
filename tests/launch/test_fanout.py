"""launch/fanout.py (bounded parallel connects, retries before anything started, the failure
table) and launch/fdlimit.py (RLIMIT_NOFILE raised, or a clear error naming the limit)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from zerorun.launch.fanout import Failed, NodeFailure, failure_table, fan_out, split_fix


def test_at_most_parallelism_in_flight_and_transient_failures_retried():
    lock = threading.Lock()
    state = {"now": 0, "peak": 0}
    calls: dict[int, int] = {}

    def connect(node: int, attempt: int) -> str:
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
            calls[node] = calls.get(node, 0) + 1
        try:
            time.sleep(0.01)
            if node == 3 and attempt < 2:
                raise NodeFailure("unreachable", "refused", transient=True)
            if node == 5:
                raise NodeFailure("auth", "node5: permission denied (publickey)")
            if node == 7:
                raise NodeFailure("unreachable", "node7: refused", transient=True)
            if node == 8:
                raise RuntimeError("bug")
            return f"conn{node}"
        finally:
            with lock:
                state["now"] -= 1

    results, failures = fan_out(range(40), connect, parallelism=4, retries=2, backoff_s=0.001)
    assert state["peak"] == 4
    assert results[3] == "conn3" and calls[3] == 3  # two refusals, then connected
    assert calls[5] == 1  # permanent: not retried
    assert calls[7] == 3 and failures[7].attempts == 3
    assert set(failures) == {5, 7, 8} and len(results) == 37
    table = failure_table(failures, what="SSH", names={n: f"node{n}" for n in range(40)})
    lines = table.splitlines()
    assert lines[0] == "SSH failed on 3 nodes: 1 auth, 1 error, 1 unreachable"
    assert lines[1].split() == ["node", "problem", "tries", "what", "fix"]
    assert lines[2].split()[:3] == ["node5", "auth", "1"] and lines[4].split()[:3] == ["node7", "unreachable", "3"]
    assert "RuntimeError: bug" in lines[3]


def test_the_table_says_which_node_what_and_the_fix():
    """Every preflight problem is reported in this one table (SSH, the agents' preflight, the
    device check, dial-in, simulation): the message's first sentence is what is wrong, the rest
    the fix; the tries column only when a node was tried more than once."""
    failures = {
        "n2": Failed("n2", "script", "the script t.py does not exist there (working directory /w). Every node needs the code.", 1),
        "n1": Failed("n1", "version", "/py there imports zerorun 1.0, this launcher is zerorun 1.1. Install the same version.", 1),
        "n3": Failed("n3", "agent", "the node agent exited with status 1 before answering", 1),
    }
    lines = failure_table(failures, what="The preflight", names={"n1": "n1 (10.0.0.1)"}).splitlines()
    assert lines[0] == "The preflight failed on 3 nodes: 1 agent, 1 script, 1 version"
    assert lines[1].split() == ["node", "problem", "what", "fix"]
    fix_at = lines[1].index("fix")
    rows = {line.split()[0]: (line[:fix_at].rstrip(), line[fix_at:]) for line in lines[2:]}
    assert rows["n1"] == ("  n1 (10.0.0.1)  version  /py there imports zerorun 1.0, this launcher is zerorun 1.1",
                          "Install the same version.")
    assert rows["n2"][0].endswith("the script t.py does not exist there (working directory /w)")
    assert rows["n2"][1] == "Every node needs the code."
    assert rows["n3"][1] == "-"  # nothing to advise beyond what happened
    assert [line.split()[0] for line in lines[2:]] == ["n3", "n2", "n1"]  # by problem, then node


@pytest.mark.parametrize(
    ("message", "what", "fix"),
    [
        ("cannot reach n1 (10.0.0.1): no answer within 2 s. Check the name.", "cannot reach n1 (10.0.0.1): no answer within 2 s", "Check the name."),
        ("port 5 is in use there (another job?). Pick another.", "port 5 is in use there (another job?)", "Pick another."),
        ("cannot log in: Authentication failed.. zerorun uses your keys.", "cannot log in: Authentication failed", "zerorun uses your keys."),
        ("zerorun 1.0 there, here zerorun 1.1. Install it.", "zerorun 1.0 there, here zerorun 1.1", "Install it."),
        ("a path e.g. x.py is missing. Copy it.", "a path e.g. x.py is missing", "Copy it."),
        ("RuntimeError: bug", "RuntimeError: bug", ""),
    ],
)
def test_split_fix(message: str, what: str, fix: str) -> None:
    assert split_fix(message) == (what, fix)


def test_the_table_is_cut_after_its_limit():
    failures = fan_out(range(80), lambda n, a: (_ for _ in ()).throw(NodeFailure("timeout", f"n{n}")), parallelism=8)[1]
    text = failure_table(failures, limit=10)
    assert text.startswith("Connecting failed on 80 nodes: 80 timeout") and text.endswith("... and 70 more")


_FD_SCRIPT = """
import resource, sys, tempfile, pathlib
from zerorun.errors import LaunchError
from zerorun.launch.joblog import JobLog
soft, hard = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
log = JobLog(pathlib.Path(tempfile.mkdtemp()), "rid")
try:
    log.open(range(2000))
except LaunchError as err:
    print("ERROR", err)
else:
    print("OK", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def test_the_soft_fd_limit_is_raised_or_the_error_names_it():
    def run(soft: int, hard: int) -> str:
        return subprocess.run([sys.executable, "-c", _FD_SCRIPT, str(soft), str(hard)], capture_output=True,
                              text=True, check=True, timeout=60).stdout

    assert run(256, 4096) == "OK 4096\n"  # 2,000 log files: the soft limit went up to the hard one
    out = run(256, 512)
    assert out.startswith("ERROR the 2000 log files under --log_dir need about 2065 more file descriptors")
    assert "(RLIMIT_NOFILE) is 512 (hard limit 512)" in out and "ulimit -Hn" in out


def test_the_ssh_fan_out_options_reach_the_connections(monkeypatch):
    from zerorun.cli.launch_cmd import normalize_argv
    from zerorun.launch.plan import LaunchOptions, Target
    from zerorun.launch.remote import ssh_options_from

    argv = normalize_argv(["--ssh_parallelism", "64", "--ssh_connect_timeout=2.5", "train.py"])
    assert argv[:3] == ["--ssh-parallelism", "64", "--ssh-connect-timeout=2.5"]
    monkeypatch.delenv("ZERORUN_SSH_PARALLELISM", raising=False)
    opts = ssh_options_from(LaunchOptions(target=Target(script="t.py"), ssh_parallelism=64, ssh_connect_timeout=2.5))
    assert opts.parallelism == 64 and opts.connect_timeout == 2.5
    assert ssh_options_from(LaunchOptions(target=Target(script="t.py"))).parallelism == 32
    monkeypatch.setenv("ZERORUN_SSH_PARALLELISM", "8")
    assert ssh_options_from(LaunchOptions(target=Target(script="t.py"))).parallelism == 8
