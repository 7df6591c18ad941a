"""Running the launcher in multi-node tests: a real `python -m zerorun` subprocess with a
deadline (on timeout its whole process group is killed and the test fails), and checks that no
process of a job is left on any fake node."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import mn_fabric as fabric

SCRIPT = Path(__file__).parent / "scripts" / "train_mn.py"
_PREFIX_PAD = re.compile(r"^(\[[\w.-]+:\d+\]) +", re.M)
NAMED_SECRET = "named-secret-value-41"
UNNAMED_SECRET = "unnamed-secret-value-42"


def launcher_env(fab: fabric.Fabric, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "GLOO_", "ZERORUN_", "MN_"))}
    env.update(
        HOME=str(fab.home),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TORCH_CPP_LOG_LEVEL="ERROR",
        NCCL_DEBUG="INFO",
        NCCL_SECRET_TOKEN=UNNAMED_SECRET,
        MN_API_TOKEN=NAMED_SECRET,
        COLUMNS="500",  # rich wraps error messages at the terminal width, 80 without a terminal
    )
    env.update(extra)
    return env


class Launch:
    """A running `python -m zerorun ...`; stdout and stderr merged, collected by a thread."""

    def __init__(self, args: list[str], *, env: dict[str, str], cwd: Path) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zerorun", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        """Everything printed so far; the console pads `[host:rank]` prefixes to one width,
        here they are followed by exactly one space so tests can match `[node1:0] text`."""
        return _PREFIX_PAD.sub(r"\1 ", "\n".join(self.lines))

    def wait_for(self, predicate: Callable[[str], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(self.output):
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    self.kill()
                    raise AssertionError(f"launcher output never matched within {timeout} s:\n{self.output}")
                self._changed.wait(min(left, 0.5))

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"launcher did not exit within {timeout} s:\n{self.output}") from None
        self._reader.join(timeout=5)
        return code

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


def run_launcher(args: list[str], *, env: dict[str, str], cwd: Path, timeout: float = 90) -> tuple[int, str]:
    launch = Launch(args, env=env, cwd=cwd)
    code = launch.finish(timeout)
    return code, launch.output


def wait_clean(nodes: list[fabric.Node], timeout: float) -> dict[str, set[int]]:
    """Wait until no job process is left on any node; returns what is left at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        left = {n.alias: n.job_pids() for n in nodes}
        if not any(left.values()) or time.monotonic() > deadline:
            return {k: v for k, v in left.items() if v}
        time.sleep(0.05)


def describe(pids: dict[str, set[int]]) -> str:
    out = []
    for alias, ps in pids.items():
        for pid in sorted(ps):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                cmd = "?"
            out.append(f"{alias}: {pid} {cmd}")
    return "\n".join(out)
