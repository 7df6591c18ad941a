"""Start a job's ranks with torchrun's environment, with a hard deadline (no launcher needed).
The spawning itself is tests/_ranks.py (shared with tests/runtime); here every rank runs to its
own end (the crash tests check how the survivors exit) and the logs stay in ``log_dir``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from _ranks import run_ranks


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


def spawn(world: int, argv: list[str], *, timeout: float = 120, env: dict[str, str] | None = None, log_dir: Path) -> list[RankResult]:
    """Run ``python ARGV`` as ``world`` CPU ranks; every rank's exit code and output."""
    results = run_ranks(
        argv, world, deadline_s=timeout, extra_env={"ZERORUN_DEVICE": "cpu", **(env or {})}, fail_fast=False, log_dir=log_dir
    )
    return [RankResult(r, rc, out) for r, (rc, out) in enumerate(results)]
