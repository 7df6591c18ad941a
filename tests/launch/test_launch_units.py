"""Pure parts of the launcher: plan, argument scanning, events wire format, exit decoding,
hang analysis, console rendering, and the supervisor driven by scripted node runners."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from zerorun.errors import LaunchError
from zerorun.launch import events
from zerorun.launch.console import PlainConsole, RichConsole, flatten_breakdown, format_bytes
from zerorun.launch.hang import hang_report, innermost_user_frame
from zerorun.launch.hosts import Host, local_hosts
from zerorun.launch.local import choose_free_port, port_is_free
from zerorun.launch.messages import NodeLost, RankEvent, RankExit, RankOutput, RankStarted
from zerorun.launch.plan import (
    DeviceInfo,
    LaunchOptions,
    Target,
    build_plan,
    find_config_argument,
    parse_rank_filter,
    parse_visible_devices,
)
from zerorun.launch.result import JobResult, RankState, describe_exit, exit_code_for
from zerorun.launch.supervisor import Supervisor

CPU = DeviceInfo(gpus=(), cores=8)
TARGET = Target(script="train.py", args=("--lr", "1"))


def _plan(hosts=None, devices=CPU, **kw):
    opts = LaunchOptions(target=TARGET, **kw)
    return build_plan(opts, hosts or local_hosts(2), devices, master_port=29500, run_id="rid")


def test_rank_env_contract_2() -> None:
    plan = _plan(pg_timeout=41.5)  # whole seconds for the runtime
    env = plan.rank_env(plan.ranks[1], event_fd=9)
    assert env == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1", "NODE_RANK": "0", "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "ZERORUN_DEVICE": "cpu", "ZERORUN_BACKEND": "gloo",
        "ZERORUN_RANKS_PER_GPU": "1", "ZERORUN_PG_TIMEOUT": "42", "ZERORUN_RUN_ID": "rid", "ZERORUN_EVENT_FD": "9",
    }
    assert plan.defaults_env(0, {}) == {"OMP_NUM_THREADS": "4"}
    assert plan.defaults_env(0, {"OMP_NUM_THREADS": "3"}) == {}
    assert plan.target.shim_argv("py") == ["py", "-m", "zerorun.shim", "train.py", "--lr", "1"]
    assert Target(module="pkg.m", args=("a",)).shim_argv("py") == ["py", "-m", "zerorun.shim", "-m", "pkg.m", "a"]


def test_multi_node_plan() -> None:
    hosts = [Host("node1", (0, 1, 2, 3)), Host("node2", (0, 1, 2, 3))]
    gpus = DeviceInfo(gpus=("0", "1", "2", "3"), cores=8, driver_present=True)
    plan = _plan(hosts, gpus, num_gpus=2, device="cuda")
    assert [(r.rank, r.local_rank, r.node_rank, r.host, r.gpu) for r in plan.ranks] == [
        (0, 0, 0, "node1", 0), (1, 1, 0, "node1", 1), (2, 0, 1, "node2", 0), (3, 1, 1, "node2", 1),
    ]
    assert plan.master_addr == "node1" and plan.backend == "nccl"
    assert plan.rank_env(plan.ranks[3])["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert plan.rank_env(plan.ranks[3])["GROUP_RANK"] == "1"
    assert plan.with_master("10.0.0.1").master_addr == "10.0.0.1"
    assert plan.omp_threads == {}  # remote nodes: their own core count decides (agent)


def test_visible_devices_and_rank_filter() -> None:
    assert parse_visible_devices(None) is None
    assert parse_visible_devices("") == ()
    assert parse_visible_devices("0,1,-1,2") == ("0", "1")
    assert parse_visible_devices(" GPU-ab12 ,MIG-x/1/2") == ("GPU-ab12", "MIG-x/1/2")
    assert parse_visible_devices("3,foo,4") == ("3",)
    assert parse_rank_filter(None, 4) is None
    assert parse_rank_filter("0, 2-3", 4) == {0, 2, 3}
    for bad in ("x", "3-1", "4"):
        with pytest.raises(LaunchError):
            parse_rank_filter(bad, 4)


def test_find_config_argument(tmp_path: Path) -> None:
    assert find_config_argument(["--deepspeed", "ds.json"]) == ("--deepspeed", "ds.json")
    assert find_config_argument(["--deepspeed_config=c.yaml", "--config", "o.json"]) == ("--deepspeed_config", "c.yaml")
    # DeepSpeed's own --deepspeed switch, with the file elsewhere
    assert find_config_argument(["--deepspeed", "--deepspeed_config", "ds.json"]) == ("--deepspeed_config", "ds.json")
    assert find_config_argument(["--deepspeed", "--lr", "1"]) is None
    assert find_config_argument(["--config", "model_small"]) is None  # not a config file
    existing = tmp_path / "settings"
    existing.write_text("{}")
    assert find_config_argument(["--config", str(existing)]) == ("--config", str(existing))
    assert find_config_argument(["--", "--config", "a.json"]) is None


def test_declared_local_rank_arg() -> None:
    from zerorun.launch.plan import declared_local_rank_arg

    assert declared_local_rank_arg("p.add_argument('--local_rank', type=int, default=-1)") == "--local_rank"
    assert declared_local_rank_arg('parser.add_argument(\n    "--local-rank", type=int)') == "--local-rank"
    assert declared_local_rank_arg("p.add_argument('-l', '--local_rank', type=int)") == "--local_rank"
    assert declared_local_rank_arg("rank = int(os.environ['LOCAL_RANK'])  # --local_rank") is None
    plan = _plan()
    from dataclasses import replace

    assert replace(plan, local_rank_arg="--local_rank").rank_argv(plan.ranks[1], "py")[-1] == "--local_rank=1"
    assert plan.rank_argv(plan.ranks[1], "py") == plan.target.shim_argv("py")


def test_options_merge_keeps_the_command_line(tmp_path: Path) -> None:
    opts = LaunchOptions(target=TARGET, num_gpus=2)
    merged = opts.merged({"num_gpus": 8, "master_port": 1234, "hostfile": "hf", "ranks_per_gpu": 2}, base_dir=tmp_path)
    assert merged.num_gpus == 2 and merged.master_port == 1234 and merged.k == 2
    assert merged.hostfile == str(tmp_path / "hf")


def test_exit_decoding() -> None:
    assert describe_exit(0) == "exit 0" and describe_exit(3) == "exit 3"
    assert describe_exit(-9).startswith("signal 9 (SIGKILL): likely the OOM killer")
    assert "/dev/shm too small" in describe_exit(-7)
    assert describe_exit(-6).startswith("signal 6 (SIGABRT)")
    assert exit_code_for(3) == 3 and exit_code_for(-9) == 137 and exit_code_for(-15) == 143
    # The names moved out of supervisor.py stay importable from it (runners and user code).
    from zerorun.launch import supervisor

    assert supervisor.RankExit is RankExit and supervisor.describe_exit is describe_exit
    assert supervisor.hang_report is hang_report and supervisor.JobResult is JobResult


def test_events_over_a_pipe() -> None:
    r, w = os.pipe()
    try:
        assert events.connect(w)
        events.emit("status", step=3, loss=1.5, obj=object())
        big = "x" * 100_000  # longer than PIPE_BUF, still one line
        threads = [threading.Thread(target=events.emit, args=("status",), kwargs={"blob": big}) for _ in range(3)]
        reader_out: list[bytes] = []
        reader = threading.Thread(target=lambda: reader_out.append(_read_all(r)))
        reader.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        events.disconnect()
        os.close(w)
        w = -1
        reader.join(10)
        lines = reader_out[0].splitlines()
        first = events.decode_line(lines[0])
        assert first["kind"] == "status" and first["step"] == 3 and first["pid"] == os.getpid()
        assert first["obj"].startswith("<object object")
        assert [len(events.decode_line(ln)["blob"]) for ln in lines[1:]] == [100_000] * 3
        assert events.decode_line(b"not json") is None and events.decode_line(b"[1]") is None
    finally:
        events.disconnect()
        os.close(r)
        if w >= 0:
            os.close(w)
    events.emit("status", step=1)  # disconnected: a no-op, no error


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_hang_analysis() -> None:
    dump = [
        "Thread 0x00007f (most recent call first):",
        '  File "/usr/lib/python3.11/threading.py", line 331 in wait',
        "",
        "Current thread 0x00007e (most recent call first):",
        '  File "/x/train.py", line 40 in all_reduce_step',
        '  File "/x/train.py", line 80 in main',
        '  File "/x/zerorun/shim.py", line 72 in main',
    ]
    assert innermost_user_frame(dump) == "train.py:40 in all_reduce_step"
    assert innermost_user_frame([]) is None
    plan = _plan(local_hosts(3))
    states = [RankState(spec) for spec in plan.ranks]
    for s, where in zip(states, ("a", "a", "b"), strict=True):
        s.stack_dump = ["Current thread 0x1 (most recent call first):", f'  File "/x/{where}.py", line 1 in f']
    report = hang_report(states)
    assert report[-1] == "behind: rank(s) 2"
    assert "no majority" in hang_report(states[1:])[-1]
    states[0].status, states[1].status, states[2].status = {"step": 9}, {"step": 8}, {"step": 9}
    assert hang_report(states)[-1] == "behind: rank(s) 1"


def test_port_helpers() -> None:
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen(1)
        assert not port_is_free(sock.getsockname()[1])
    port = choose_free_port()
    assert 1024 < port < 32768 and port_is_free(port)


def test_console_rendering() -> None:
    assert format_bytes(None) == "-" and format_bytes(512) == "512 B" and format_bytes(3 * 2**30) == "3.0 GiB"
    assert flatten_breakdown({"params": 4, "cuda:0": {"grads": 2, "x": "no"}, "flag": True}) == {
        "params": 4, "cuda:0.grads": 2,
    }
    plan = _plan(num_gpus=2)
    out, err = io.StringIO(), io.StringIO()
    console = PlainConsole(ranks=frozenset({1}), out=out, err=err)
    states = [RankState(spec) for spec in plan.ranks]
    console.begin(plan, states)
    console.output([RankOutput(0, "stdout", "hidden"), RankOutput(1, "stdout", "a"), RankOutput(1, "stderr", "b")])
    assert out.getvalue() == "[1] a\n" and "[1] b\n" in err.getvalue()
    states[0].returncode, states[0].state, states[0].breakdown = 0, "exited", {"params": 2048}
    states[1].returncode, states[1].state, states[1].error = -9, "failed", {"type": "E", "message": "m"}
    states[1].stderr_tail.append("last words")
    result = JobResult(exit_code=137, reason="rank_failed", ranks=states, wall_s=1.0, first_failure=1, message="boom")
    console.end(result)
    text = err.getvalue()
    assert "FAILED" in text and "signal 9 (SIGKILL)" in text and "last words" in text and "exception: E: m" in text
    assert "2.0 KiB" in text and "\x1b[" not in text
    rich_out = io.StringIO()
    rich = RichConsole()
    from rich.console import Console

    rich.console = Console(file=rich_out, force_terminal=True, width=120)
    rich.begin(plan, states)
    rich.output([RankOutput(0, "stdout", "[bold]not markup[/bold]")])
    rich.refresh()
    rich.end(result)
    assert "[bold]not markup[/bold]" in rich_out.getvalue() and "job failed" in rich_out.getvalue()
    # multi-node prefixes look like markup tags; the live panel must print them as they are
    two = _plan([Host("node1", (0,)), Host("node2", (0,))])
    rich_out.truncate(0)
    rich.begin(two, [RankState(spec) for spec in two.ranks])
    rich.refresh()
    rich.stop()
    assert "[node2:1]" in rich_out.getvalue()


class ScriptedRunner:
    """A NodeRunner that replays messages (the protocol, without processes)."""

    def __init__(self, node, script) -> None:
        self.node = node
        self.script = script
        self.signals: list[tuple[int, bool]] = []
        self.killed = 0

    def start(self, sink) -> None:
        self.sink = sink
        for msg in self.script:
            sink(msg)

    def signal(self, sig: int, *, tree: bool = True) -> None:
        self.signals.append((sig, tree))
        for r in self.node.ranks:
            self.sink(RankExit(r.rank, -sig))

    def kill(self) -> None:
        self.killed += 1

    def close(self) -> None:
        pass


def test_line_cutting_handles_progress_bars() -> None:
    """`\\r` redraws become lines at once; `\\r\\n` split across reads is one line end."""
    from zerorun.launch.local import LocalRunner, _Stream

    got: list[str] = []
    runner = LocalRunner.__new__(LocalRunner)
    runner._sink = lambda msg: got.append(msg.text)
    s = _Stream(0, "stdout", -1)
    for piece in (b"epoch 1\n\r 10%|#", b"\r 20%|##\r", b"\ndone\r", b"\n\nutf8 \xc3", b"\xa9\n", b"tail"):
        s.buf += piece
        runner._emit_lines(s)
    assert got == ["epoch 1", " 10%|#", " 20%|##", "done", "", "utf8 \u00e9"]
    assert bytes(s.buf) == b"tail"


def test_supervisor_fail_fast_across_nodes_and_node_lost(tmp_path: Path) -> None:
    hosts = [Host("a", (0,)), Host("b", (0,))]
    plan = _plan(hosts)
    node_a = ScriptedRunner(plan.nodes[0], [RankStarted(0, 100), RankOutput(0, "stdout", "hi")])
    node_b = ScriptedRunner(plan.nodes[1], [RankStarted(1, 200), RankEvent(1, {"kind": "status", "step": 4}), RankExit(1, 3)])
    err = io.StringIO()
    result = Supervisor(plan, [node_a, node_b], PlainConsole(out=io.StringIO(), err=err), log_dir=tmp_path).run()
    assert result.exit_code == 3 and result.first_failure == 1
    assert node_a.signals == [(signal.SIGTERM, True)] and node_a.killed and node_b.killed
    assert [s.state for s in result.ranks] == ["stopped", "failed"]
    assert json.loads((tmp_path / "summary.json").read_text())["ranks"][1]["status"] == {"step": 4}
    assert (tmp_path / "rank0.log").read_text() == "hi\n"

    node_a = ScriptedRunner(plan.nodes[0], [RankStarted(0, 100)])
    node_b = ScriptedRunner(plan.nodes[1], [RankStarted(1, 200), NodeLost(1, "connection reset")])
    result = Supervisor(plan, [node_a, node_b], PlainConsole(out=io.StringIO(), err=io.StringIO())).run()
    assert result.exit_code == 255 and result.reason == "node_lost" and "node b" in result.message
    assert [s.state for s in result.ranks] == ["stopped", "lost"]


def test_shim_runs_a_script_like_python(tmp_path: Path) -> None:
    """Without a launcher: __name__, argv, sys.path[0], exit codes, clean tracebacks."""
    script = tmp_path / "s.py"
    script.write_text(
        "import os, sys\n"
        "print(__name__, sys.argv, sys.path[0] == os.path.dirname(os.path.abspath(__file__)))\n"
        "if sys.argv[1] == 'exit': sys.exit(5)\n"
        "if sys.argv[1] == 'raise': raise KeyError('k')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("ZERORUN_EVENT_FD", None)

    def shim(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "zerorun.shim", *args], env=env, capture_output=True, text=True, timeout=60, cwd="/")

    res = shim(str(script), "exit")
    assert res.returncode == 5 and res.stdout == f"__main__ ['{script}', 'exit'] True\n"
    res = shim(str(script), "raise")
    assert res.returncode == 1 and res.stderr.startswith("Traceback") and res.stderr.rstrip().endswith("KeyError: 'k'")
    assert "zerorun/shim.py" not in res.stderr and "runpy" not in res.stderr
    res = shim()
    assert res.returncode == 2 and "usage" in res.stderr
