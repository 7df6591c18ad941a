"""Running each configuration in a process (group) of its own, with a deadline.

One configuration = one launch: a single `python` process for world 1, or `torchrun` /
`zerorun` for several ranks. Each launch starts a new session, so on its deadline the whole
tree (launcher and ranks) is killed with one killpg and the next configuration still runs.
Whatever happens, a record comes out: the worker's own, or one built here from the exit code
and the tail of the output (timeout, crash, OOM kill).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["LaunchSpec", "launch_command", "run_launch", "LaunchOutcome", "finish_record", "free_port"]


@dataclass(frozen=True)
class LaunchSpec:
    launcher: str  # "none" (one process), "torchrun" or "zerorun"
    nproc: int  # ranks
    ranks_per_gpu: int = 1
    device: str = "auto"  # the worker's --device; the zerorun launcher is told "cpu" too


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_command(spec: LaunchSpec, script: str, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """(argv, environment additions) that run `script args` on `spec.nproc` ranks."""
    py = sys.executable
    if spec.launcher == "none":
        if spec.nproc != 1:
            raise ValueError("launcher 'none' runs one process; use torchrun or zerorun for --nproc > 1")
        env = {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
        return [py, script, *args], env
    if spec.launcher == "torchrun":
        cmd = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={spec.nproc}"]
        return [*cmd, script, *args], {}
    if spec.launcher == "zerorun":
        if spec.nproc % spec.ranks_per_gpu:
            raise ValueError(
                f"--nproc {spec.nproc} is not a multiple of --ranks-per-gpu {spec.ranks_per_gpu}"
            )
        # zerorun's --num_gpus counts ranks; with --ranks_per_gpu K they share nproc/K GPUs.
        cmd = [py, "-m", "zerorun", "--num_gpus", str(spec.nproc)]
        if spec.device == "cpu":
            cmd += ["--device", "cpu"]  # CPU ranks share nothing: no --ranks_per_gpu there
        elif spec.ranks_per_gpu > 1:
            cmd += ["--ranks_per_gpu", str(spec.ranks_per_gpu)]
        return [*cmd, script, *args], {}
    raise ValueError(f"unknown launcher {spec.launcher!r}: use none, torchrun or zerorun")


@dataclass
class LaunchOutcome:
    returncode: int | None
    timed_out: bool
    wall_s: float
    tail: list[str]


def run_launch(
    argv: list[str], env_extra: dict[str, str], timeout_s: float, prefix: str, echo: bool = True
) -> LaunchOutcome:
    """Run to completion or deadline, echoing output lines with `prefix`; keep the last 60."""
    env = {**os.environ, **env_extra, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
        errors="replace",
    )
    tail: deque[str] = deque(maxlen=60)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            if echo:
                print(f"{prefix} {line}", end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_tree(proc)
    except BaseException:
        _kill_tree(proc)
        raise
    reader.join(timeout=5)
    return LaunchOutcome(proc.returncode, timed_out, time.monotonic() - start, list(tail))


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    """SIGTERM the launch's whole session, SIGKILL what is left after 5 s."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        hint = " (likely the OOM killer)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exit code {code}"


def finish_record(
    result_file: Path, outcome: LaunchOutcome, base: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """The configuration's final record: the worker's, completed with how the launch went;
    or, if the worker wrote none, one describing the failure."""
    record: dict[str, Any] | None = None
    if result_file.exists():
        try:
            record = json.loads(result_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            record = None
    if record is None:
        record = dict(base)
        if outcome.timed_out:
            record.update(status="timeout", error=f"no result within the {timeout_s:.0f} s deadline; killed")
        else:
            code = outcome.returncode
            status = "crashed" if code is not None and code < 0 else "failed"
            record.update(status=status, error=f"no result: {_describe_exit(code)}")
    elif record.get("status") == "ok" and outcome.timed_out:
        # The result was written, then teardown hung: keep the numbers, say so.
        record["note"] = "process group teardown hit the deadline after the result was written"
    record.update(
        launch_returncode=outcome.returncode,
        launch_timed_out=outcome.timed_out,
        launch_wall_s=outcome.wall_s,
    )
    if record.get("status") != "ok":
        record["output_tail"] = outcome.tail[-40:]
    return record
