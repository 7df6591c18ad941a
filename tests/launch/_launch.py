"""Running the real launcher from tests: deadlines, cleanup, and finding leftover processes.

Every launch gets a unique `ZR_TAG` in its environment; ranks and their children inherit it,
so `tagged_processes(tag)` finds whatever a job left behind (zombies do not count: they are
dead, and PID 1 here reaps orphans only every second or two).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
RANK_JOB = SCRIPTS / "rank_job.py"


@dataclass
class Launch:
    proc: subprocess.Popen[str]
    tag: str

    def finish(self, timeout: float) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tagged(self.tag)
            out, err = self.proc.communicate(timeout=10)
            raise AssertionError(f"launcher did not finish in {timeout} s\nstdout:\n{out}\nstderr:\n{err}") from None
        return self.proc.returncode, out, err


def base_env(extra: Mapping[str, str] | None = None) -> tuple[dict[str, str], str]:
    tag = uuid.uuid4().hex
    env = dict(os.environ)
    env.update(
        {
            "ZR_TAG": tag,
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            "PYTHONPATH": str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
            "TORCH_CPP_LOG_LEVEL": "ERROR",
        }
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(extra or {})
    return env, tag


def start(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> Launch:
    full_env, tag = base_env(env)
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerorun", *args],
        env=full_env,
        cwd=str(cwd or REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return Launch(proc, tag)


def run(
    args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path | None = None, timeout: float = 90
) -> tuple[int, str, str, str]:
    launch = start(args, env=env, cwd=cwd)
    try:
        code, out, err = launch.finish(timeout)
    finally:
        kill_tagged(launch.tag)
    return code, out, err, launch.tag


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[-1].split()[0].decode()
    except OSError:
        return None


def tagged_processes(tag: str) -> list[int]:
    needle = f"ZR_TAG={tag}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
        except OSError:
            continue
        state = _state(int(name))
        if state not in (None, "Z", "X"):
            found.append(int(name))
    return found


def kill_tagged(tag: str) -> None:
    for pid in tagged_processes(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def wait_until_gone(tag: str, timeout: float) -> list[int]:
    """Pids still alive after `timeout` seconds (empty: everything is gone)."""
    deadline = time.monotonic() + timeout
    while True:
        left = tagged_processes(tag)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def describe(pids: Sequence[int]) -> str:
    out = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            cmd = "?"
        out.append(f"{pid} [{_state(pid)}] {cmd}")
    return "\n".join(out)
