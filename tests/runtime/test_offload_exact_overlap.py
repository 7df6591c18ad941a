"""The exact CPU offload step (no clipping: started in the backward) returns before the CPU has
updated every flat buffer, and the next forward starts on the buffers it needs first while the
CPU steps the rest (deferred write-backs: FlatStage's module hooks at stages 1-2, the groups'
settle at stage 3; docs/offload.md). Proved by the order of the placement's own events on gloo
CPU ranks (_exact_overlap_worker.py); the numerics of the same schedule against plain PyTorch are
test_offload.py's (its clip-0 cases run it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ._spawn import spawn_ranks

HERE = Path(__file__).resolve().parent
CASES = ["z1", "z2", "z3", "z2-compiled", "z2-recomputed", "z3-recomputed"]
WORLDS = [1, 2]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    out = {}
    for world in WORLDS:
        path = tmp_path_factory.mktemp(f"overlap-w{world}") / "results.json"
        spawn_ranks(HERE / "_exact_overlap_worker.py", world, [str(path)], deadline_s=240)
        out[world] = json.loads(path.read_text())
    return out


@pytest.mark.parametrize("world", WORLDS, ids=[f"w{w}" for w in WORLDS])
@pytest.mark.parametrize("case", CASES)
def test_next_forward_starts_while_the_cpu_steps_the_last_buffer(results: dict, world: int, case: str) -> None:
    for rank, r in enumerate(results[world][case]):
        assert "error" not in r, r.get("error")
        assert r["timeouts"] == [], (rank, r["timeouts"])
        if world > 1 and not case.startswith("z3"):
            # Stages 1-2 at world > 1 settle every buffer in the step (flat_stage.py: a reader on
            # one rank alone must not have to issue an all-gather): nothing deferred, same losses.
            assert r["deferrable"] == [] and r["returned_pending"] == [0] * len(r["returned_pending"]), r
            assert r["losses"]["held"] == r["losses"]["plain"], r["losses"]
            continue
        assert len(r["deferrable"]) >= 3, r["deferrable"]
        # The held update of the buffer the forward needs last started only after step() ...
        assert r["last_update_started_after_step"] is True
        # ... and was still not done when the forward's first module ran: step() returned and
        # the forward began without it, while it was in flight.
        assert r["last_stepped_at_forward"] is False, r
        assert r["last"] in r["in_flight_at_forward"], r
        # From the second step on (destinations known) every step returns with write-backs in
        # flight; the first one cannot (it learns the destinations).
        assert r["returned_pending"][0] == 0 and all(n > 0 for n in r["returned_pending"][1:]), r
        if not case.startswith("z3"):  # (FlatStage counts them)
            assert r["deferred_steps"] == len(r["returned_pending"]) - 1
        # Holding the worker changed nothing but the timing.
        assert r["losses"]["held"] == r["losses"]["plain"], r["losses"]
