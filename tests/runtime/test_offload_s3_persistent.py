"""Stage 3 at one rank with CPU optimizer offload and no clipping: the persistent group's
write-back is deferred like every group's (it was waited for in step(): its gradient is final
only at the end of the backward, so step() waited for the GPU to finish the backward and for the
worker -- 0.16 s on the H200) and settled before anything reads it. One gloo rank; the worker is
held before it updates the persistent buffer (_s3_persistent_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

from ._spawn import spawn_ranks

HERE = Path(__file__).resolve().parent


def test_persistent_group_is_deferred_and_settled_before_reads(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    spawn_ranks(HERE / "_s3_persistent_worker.py", 1, [str(out)], deadline_s=120)
    r = json.loads(out.read_text())
    assert "error" not in r, r.get("error")
    plain, held = r["plain"], r["held"]
    persistent = held["persistent"]
    assert persistent, "the model has no persistent group"
    # From the second step on step() returns with every write-back in flight, the persistent
    # group's included; at the held step its update had not even run when step() returned.
    for got in (plain["returned_in_flight"], held["returned_in_flight"]):
        assert got[0] == [] and all(set(persistent) <= set(x) for x in got[1:]), got
    assert held["persistent_stepped_at_return"] is False
    # The reader (state_dict) waited for the held update, then saw it: the same values as the
    # unheld run, as did GatheredParameters on a persistent parameter and every later forward.
    assert held["reader_waited_s"] >= 0.1, held["reader_waited_s"]
    assert held["state_dict"] == plain["state_dict"]
    assert held["gathered_norm"] == plain["gathered_norm"]
    assert held["losses"] == plain["losses"]
    # The training thread's waits for the CPU step: in the forward (settle), not in step().
    assert "settle_wait_s" in held["profile"], held["profile"]
