"""Start N real ranks of a script the way torchrun (or srun) would -- environment only -- with a
deadline. Shared by the test packages that spawn ranks without a launcher (tests/runtime,
tests/runtime/checkpoint); pytest puts tests/ on sys.path, so they import it as ``_ranks``.

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

__all__ = ["REPO", "free_port", "launcher_env", "run_ranks"]

REPO = Path(__file__).resolve().parents[1]
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(style: str, rank: int, world: int, port: int) -> dict[str, str]:
    """The variables a rank gets from torchrun (and zerorun) or from srun, on one node."""
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
        "GROUP_RANK": "0",
        "NODE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _port_taken(output: str) -> bool:
    return "EADDRINUSE" in output or "address already in use" in output.lower()


def run_ranks(
    argv: list[str],
    world: int,
    *,
    deadline_s: float,
    extra_env: dict[str, str] | None = None,
    style: str = "torchrun",
    fail_fast: bool = True,
    log_dir: Path | None = None,
) -> list[tuple[int, str]]:
    """Run ``python ARGV`` as ``world`` ranks; [(returncode, combined output)] per rank.

    ``fail_fast``: once a rank exits non-zero the others get 2 s to fail on their own (and
    flush) before they are killed; without it every rank runs to its end or the deadline (tests
    that check how the survivors of a crash exit). Ranks killed at the deadline read -9. When the
    rendezvous port was taken meanwhile (free_port() cannot reserve it and other jobs share the
    machine), the job runs once more on a fresh port. Logs go to ``log_dir`` (kept) or to
    temporary files."""
    results = _run_once(argv, world, deadline_s, extra_env, style, fail_fast, log_dir)
    if any(_port_taken(out) for _, out in results):
        results = _run_once(argv, world, deadline_s, extra_env, style, fail_fast, log_dir)
    return results


def _run_once(
    argv: list[str],
    world: int,
    deadline_s: float,
    extra_env: dict[str, str] | None,
    style: str,
    fail_fast: bool,
    log_dir: Path | None,
) -> list[tuple[int, str]]:
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    logs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
        env.update(launcher_env(style, rank, world, port))
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
        if log_dir is not None:
            path = log_dir / f"rank{rank}.log"
        else:
            path = Path(os.environ.get("TMPDIR", "/tmp")) / f"zr-rank-{os.getpid()}-{port}-{rank}.log"
        log = open(path, "w+")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(
            subprocess.Popen(
                # Through zerorun's shim, as real ranks start: it runs the script exactly as
                # `python SCRIPT` would, but exits with the script's status without the C++
                # teardown in which torch 2.13's gloo can abort (SIGABRT instead of the status).
                [sys.executable, "-m", "zerorun.shim", *argv],
                env=env,
                cwd=str(REPO),
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    end = time.monotonic() + deadline_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() <= end:
            if fail_fast and any(p.poll() not in (None, 0) for p in procs):
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
        if log_dir is None:
            os.unlink(log.name)
    return results
