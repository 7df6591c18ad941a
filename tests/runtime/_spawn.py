"""Start N real ranks of a script the way torchrun would (environment only), with a deadline.

The ranks run in their own session so a hung or failed job is killed as a whole process group
(pytest-timeout cannot interrupt a rank stuck in a collective; test-machine-facts.md).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher_env(style: str, rank: int, world: int, port: int) -> dict[str, str]:
    """The variables a rank gets from torchrun (and zerorun) or from srun."""
    if style == "slurm":
        # srun gives no MASTER_ADDR: zerorun takes the first host of the node list.
        return {
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": str(world),
            "SLURM_LOCALID": str(rank),
            "SLURM_JOB_NODELIST": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def spawn_ranks(
    script: Path,
    world: int,
    args: list[str],
    *,
    deadline_s: float,
    extra_env: dict[str, str] | None = None,
    style: str = "torchrun",
) -> list[tuple[int, str]]:
    """Run ``script`` as ``world`` ranks; return [(returncode, combined output)] per rank.
    Raises AssertionError (with every rank's output) on timeout or a failing rank."""
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    logs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("SLURM_")}
        env.update(_launcher_env(style, rank, world, port))
        env.update(
            OMP_NUM_THREADS="1",
            ZERORUN_PG_TIMEOUT="60",
            ZERORUN_DEVICE=os.environ.get("ZERORUN_TEST_DEVICE", "cpu"),
            PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
            TORCH_CPP_LOG_LEVEL="ERROR",
            PYTHONUNBUFFERED="1",
        )
        env.pop("ZERORUN_EVENT_FD", None)
        env.update(extra_env or {})
        log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"zr-rank-{os.getpid()}-{port}-{rank}.log", "w+")  # noqa: SIM115
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                cwd=str(REPO),
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    end = time.monotonic() + deadline_s
    timed_out = False
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > end:
                timed_out = True
                break
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2.0)  # let the others fail on their own and flush, then stop them
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs:
            p.wait(timeout=10)
    results = []
    for p, log in zip(procs, logs, strict=True):
        log.seek(0)
        results.append((p.returncode, log.read()))
        log.close()
        os.unlink(log.name)
    if timed_out or any(rc != 0 for rc, _ in results):
        detail = "\n".join(f"--- rank {r} rc={rc}\n{out[-6000:]}" for r, (rc, out) in enumerate(results))
        raise AssertionError(
            f"{'timed out' if timed_out else 'a rank failed'} ({script.name}, world {world}):\n{detail}"
        )
    return results
