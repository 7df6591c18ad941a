"""Start a job's ranks with torchrun's environment, with a hard deadline (no launcher needed)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, argv: list[str], *, timeout: float = 120, env: dict[str, str] | None = None, log_dir: Path) -> list[RankResult]:
    """Run the ranks; once more on a fresh port if the rendezvous port was taken meanwhile
    (free_port() cannot reserve it, and other test jobs run on this machine too)."""
    results = _spawn_once(world, argv, timeout=timeout, env=env, log_dir=log_dir)
    if any("EADDRINUSE" in r.output or "address already in use" in r.output.lower() for r in results):
        results = _spawn_once(world, argv, timeout=timeout, env=env, log_dir=log_dir)
    return results


def _spawn_once(world: int, argv: list[str], *, timeout: float, env: dict[str, str] | None, log_dir: Path) -> list[RankResult]:
    port = free_port()
    procs = []
    for r in range(world):
        e = dict(os.environ)
        e.update(env or {})
        e.update(
            RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
            GROUP_RANK="0", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            OMP_NUM_THREADS="1", ZERORUN_PG_TIMEOUT="60", ZERORUN_DEVICE="cpu", TORCH_CPP_LOG_LEVEL="ERROR",
        )
        log = open(log_dir / f"rank{r}.log", "w")  # noqa: SIM115 - closed below
        p = subprocess.Popen([sys.executable, *argv], env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append((p, log))
    deadline = time.monotonic() + timeout
    try:
        for p, _ in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log.close()
    return [
        RankResult(r, p.returncode, (log_dir / f"rank{r}.log").read_text()) for r, (p, _) in enumerate(procs)
    ]
