"""Stage 3's keep/prefetch decisions, and one rank with real collectives against plain PyTorch.

* ``stage3_max_reuse_distance`` as DeepSpeed reads it: a group stays gathered after its forward
  only if fewer than that many elements are gathered before its next use -- 0 keeps nothing
  (the last block, whose next use follows at distance 0, was kept with 0 before).
* One rank with ``ZERORUN_DEBUG_COLLECTIVES=1`` (the benchmark's fair world-1 row): gathers cast
  into the gather buffer's own slot and all-gather in place, gradients reduce-scatter in place
  (the staging buffer becomes the shard), nothing is prefetched or kept (there is no
  communication to hide or save) -- and training still equals plain PyTorch (the stage-3
  matrix's tolerances, test_stage3.py), with the same gathered-parameter peak as the default
  world-1 path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerorun.runtime.stage3.param_group import RELEASED
from zerorun.runtime.stage3.schedule import Schedule

from ._spawn import spawn_ranks
from .test_stage3 import _check_equivalence, _check_estimated_buffers

HERE = Path(__file__).resolve().parent
CASES = ["fp32-ga4-clip0", "bf16-ga1-clip0.05", "bf16-ga4-clip0"]
# DeepSpeed's defaults: with several ranks the last blocks would stay gathered
ZERO = json.dumps({"stage3_max_reuse_distance": 10**9, "stage3_prefetch_bucket_size": 10**9})


class _Group:
    """What Schedule reads of a ParamGroup."""

    def __init__(self, index: int, numel: int) -> None:
        self.index = index
        self.numel = numel
        self.resident = False
        self.state = RELEASED
        self.prefetch_pays = True

    @property
    def live(self) -> bool:
        return self.state != RELEASED


def _schedule(numels: list[int], reuse: int) -> tuple[Schedule, list[_Group]]:
    groups = [_Group(i, n) for i, n in enumerate(numels)]
    s = Schedule(groups, prefetch_numel=0, max_live_numel=10**12, max_reuse_distance=reuse)  # type: ignore[arg-type]
    order = list(range(len(groups)))
    s.fwd_prev = order
    s.fwd_cur = []
    return s, groups


def _kept(numels: list[int], reuse: int) -> list[int]:
    """Indices kept after their forward, for a forward running the groups in index order."""
    s, groups = _schedule(numels, reuse)
    out = []
    for g in groups:
        s.fwd_cur.append(g.index)
        if s.keep_after_forward(g):  # type: ignore[arg-type]
            out.append(g.index)
    return out


def test_reuse_distance_zero_keeps_nothing() -> None:
    # the last group's next use (its backward) follows at distance 0: DeepSpeed releases it at 0
    assert _kept([100, 100, 100, 100], 0) == []


def test_reuse_distance_counts_elements_gathered_before_the_next_use() -> None:
    # group i's next use is its backward: the groups after it run forward and backward first
    # (2 x their elements); kept when that is below the distance
    numels = [100, 100, 100, 100]
    assert _kept(numels, 1) == [3]
    assert _kept(numels, 200) == [3]  # group 2: 2 x 100 = 200, not below 200
    assert _kept(numels, 201) == [2, 3]
    assert _kept(numels, 10**9) == [0, 1, 2, 3]


def test_prediction_mismatch_keeps_nothing() -> None:
    s, groups = _schedule([100, 100], 10**9)
    s.fwd_cur = [1]  # this forward started with another group than the recorded one
    assert not s.keep_after_forward(groups[1])  # type: ignore[arg-type]


def test_peak_recorded_without_prefetch() -> None:
    """With nothing to prefetch (one rank), the gathered peak is still recorded: it is part of
    engine.memory_summary()'s buffers."""
    s, groups = _schedule([100, 50], 0)
    for g in groups:
        g.prefetch_pays = False
    groups[0].state = 2
    s.prefetch(groups[0], [1])  # type: ignore[arg-type]
    assert s.peak_live_numel == 100 and s.prefetches == 0


@pytest.fixture(scope="module")
def one_rank_real(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("s3real")
    out = base / "results.json"
    spawn_ranks(
        HERE / "_s3_worker.py",
        1,
        [str(out)],
        deadline_s=240,
        extra_env={
            "ZERORUN_DEBUG_COLLECTIVES": "1",
            "ZR_S3_CASES": ",".join(CASES),
            "ZR_S3_ZERO": ZERO,
        },
    )
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", CASES)
def test_one_rank_real_collectives_match_reference(one_rank_real: dict, name: str) -> None:
    r = one_rank_real[name]
    _check_equivalence(r, 1, name)
    for x in r["ranks"]:
        assert x["launches"] > 0, "no reduce-scatter was issued: the collectives were skipped"
        assert x["prefetches"] == 0, "one rank: nothing to overlap, nothing may be prefetched"
        if name.startswith("bf16"):  # (fp32 at one rank: the shard is the gathered buffer)
            # gathered on demand, one group at a time (+ the root group, gathered for the pass)
            assert 0 < x["peak_live_numel"] <= x["root_numel"] + x["max_group_numel"], x
        else:
            assert x["peak_live_numel"] == 0, x
        mem = next(iter(x["memory"].values()))
        assert mem["grads"] == 0, mem  # the in-place shards go at the step like the others
        # one group's staging at a time: the previous reduction is retired before the next
        assert 0 < x["peak_staging_bytes"] <= x["max_group_staging_bytes"], x["peak_staging_bytes"]
        # zerorun.estimate for the same keys: root group + one group gathered (bf16), nothing (fp32)
        cfg = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 3, **json.loads(ZERO)}}
        cfg["bf16"] = {"enabled": name.startswith("bf16")}
        cfg["gradient_accumulation_steps"] = int(name.split("-ga")[1].split("-")[0])
        psi = x["partitioned_numel"] + x["persistent_bytes"] // (4 if name.startswith("fp32") else 2)
        _check_estimated_buffers(x, mem, 1, cfg, psi, debug_collectives=True)

