"""Stage 3's initialize builds the fp32 master shards where the placement keeps them, one group at
a time (runtime/stage3/build.py), on 2 real gloo ranks (_s3_build_worker.py, one launch):

* each group's fp32 initial values are cut on the placement's optimizer device (the host under
  optimizer offload: on a GPU run of this test that is the difference between cuda and cpu);
* under optimizer offload no cut shard of an earlier group is alive when the next group is cut,
  and none after initialize (the masters are the only fp32 copy), for CPU and NVMe masters,
  Twin-Flow's split, and models built normally or under ``zero.Init(remote_device="cpu")``;
* without offload a partitioned group's fp32 at-rest shard is its master and the cut values are
  dropped once the group is built (initialize held them all before: 8 B/param on the GPU);
* the masters are bit for bit the fp32 values of the same model built normally from the same
  seed (not their bf16 rounding), and a training step runs from them.

The host memory this saves is measured by tests/benchmarks/test_largest_model_init.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ._spawn import results_per_world

HERE = Path(__file__).resolve().parent
WORLD = 2
OFFLOADED = ["cpu-cpu", "cpu-cpu-init", "cpu-none", "nvme-cpu", "nvme-none-init", "ratio-cpu", "ratio-none"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    return results_per_world(tmp_path_factory, HERE / "_s3_build_worker.py", prefix="s3b", deadline_s=240)(
        WORLD
    )


@pytest.mark.parametrize("case", OFFLOADED)
def test_offloaded_masters_are_cut_on_the_host_one_group_at_a_time(results, case: str) -> None:  # noqa: ANN001
    for rank, r in enumerate(results[case]):
        assert r["optimizer_device"] == "cpu"
        assert r["groups"] >= 3 and len(r["cuts"]) == r["groups"], r
        assert {c["device"] for c in r["cuts"]} == {"cpu"}, f"rank {rank}: fp32 values cut on {r['cuts']}"
        held = [c["alive_before"] for c in r["cuts"]]
        assert held == [0] * len(held), f"rank {rank}: fp32 shards of earlier groups still alive: {held}"
        assert r["alive_after"] == 0, f"rank {rank}: {r['alive_after']} fp32 shards outlived initialize"
        if not case.startswith("ratio"):
            assert r["master_devices"] == ["cpu"], r["master_devices"]


@pytest.mark.parametrize("case", ["ratio-cpu", "ratio-none"])
def test_twinflow_split_is_planned_before_the_masters_are_made(results, case: str) -> None:  # noqa: ANN001
    for r in results[case]:
        assert 0 < r["twinflow_device_masters"] < r["n_masters"], r


def test_twinflow_device_groups_keep_the_master_as_the_at_rest_parameter(results) -> None:  # noqa: ANN001
    """Parameters on the device: a partitioned group whose masters Twin-Flow keeps on the device
    has no 16-bit at-rest shard -- the fp32 master is it, as without offload; the host's groups
    keep a 16-bit one. With the parameters offloaded every at-rest shard is 16-bit."""
    for case, params_on_device in (("ratio-none", True), ("ratio-cpu", False)):
        for r in results[case]:
            rest = r["rest"]
            assert any(on for on, _, _ in rest) and not all(on for on, _, _ in rest), rest
            for on, dtype, is_master in rest:
                kept = on and params_on_device
                assert (dtype == "torch.float32", is_master) == (kept, kept), (case, rest)


def test_without_offload_the_fp32_at_rest_shards_are_the_masters(results) -> None:  # noqa: ANN001
    for r in results["none-none"]:
        assert {c["device"] for c in r["cuts"]} == {r["training_device"]}
        # A partitioned group's fp32 at-rest shard is its master: the cut values are dropped
        # after the group is built. Only the persistent group's masters (its at-rest parameters
        # are 16-bit) are the cut shards themselves.
        held = [c["alive_before"] for c in r["cuts"]]
        assert max(held) <= r["persistent_masters"] == r["alive_after"] < r["n_masters"], r


@pytest.mark.parametrize("case", [*OFFLOADED, "none-none"])
def test_masters_start_at_the_fp32_initialization(results, case: str) -> None:  # noqa: ANN001
    for rank, r in enumerate(results[case]):
        assert r["masters_not_bf16"], "the test model's values must not all be bf16-representable"
        assert r["masters_exact"], f"rank {rank}: master shards differ from the fp32 initialization"
        assert r["loss"] == r["loss"] and abs(r["loss"]) < 1e3
