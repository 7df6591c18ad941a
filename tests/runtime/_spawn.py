"""Start N real ranks of a script the way torchrun would (environment only), with a deadline;
a failed or hung job is an AssertionError with every rank's output. The spawning itself is
tests/_ranks.py (shared with tests/runtime/checkpoint)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _ranks import REPO, run_ranks

__all__ = ["REPO", "results_per_world", "spawn_ranks"]


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
    start = time.monotonic()
    results = run_ranks([str(script), *args], world, deadline_s=deadline_s, extra_env=extra_env, style=style)
    if any(rc != 0 for rc, _ in results):
        timed_out = time.monotonic() - start >= deadline_s
        detail = "\n".join(f"--- rank {r} rc={rc}\n{out[-6000:]}" for r, (rc, out) in enumerate(results))
        raise AssertionError(
            f"{'timed out' if timed_out else 'a rank failed'} ({script.name}, world {world}):\n{detail}"
        )
    return results


def results_per_world(
    tmp_path_factory: Any,
    script: Path,
    *,
    prefix: str,
    deadline_s: float,
    extra_args: Callable[[Path], list[str]] | None = None,
    after: Callable[[Path, dict], None] | None = None,
) -> Callable[[int], dict]:
    """For a module-scoped ``results`` fixture: one launch per world size runs every case of
    ``script``, whose rank 0 writes {case: result} as JSON to its first argument. Results are
    cached per world; a failed launch fails its other tests at once instead of relaunching per
    test. ``ZR_TEST_DEADLINE`` overrides ``deadline_s``; ``extra_args(base)`` adds arguments
    (files under the launch's own folder), ``after(base, results)`` inspects it afterwards."""
    cache: dict[int, dict] = {}
    failed: dict[int, str] = {}

    def get(world: int) -> dict:
        if world in failed:
            raise AssertionError(
                f"the world {world} launch failed (the first test using it shows why): {failed[world]}"
            )
        if world not in cache:
            base = tmp_path_factory.mktemp(f"{prefix}{world}")
            out = base / "results.json"
            args = [str(out), *(extra_args(base) if extra_args else [])]
            try:
                spawn_ranks(script, world, args, deadline_s=float(os.environ.get("ZR_TEST_DEADLINE", deadline_s)))
            except AssertionError as e:
                failed[world] = str(e).splitlines()[0]
                raise
            results = json.loads(out.read_text())
            if after is not None:
                after(base, results)
            cache[world] = results
        return cache[world]

    return get
