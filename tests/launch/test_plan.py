"""launch/plan.py: the rank layout, the environment each rank gets (Contract 2), device and rank
selectors, options merged with the config's launcher section."""

from __future__ import annotations

from pathlib import Path

import pytest
from _plans import TARGET, plan_for

from zerorun.errors import LaunchError
from zerorun.launch.hosts import Host
from zerorun.launch.plan import DeviceInfo, LaunchOptions, Target, parse_rank_filter, parse_visible_devices


def test_rank_env_contract_2() -> None:
    plan = plan_for(pg_timeout=41.5)  # whole seconds for the runtime
    env = plan.rank_env(plan.ranks[1], event_fd=9)
    assert env == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1", "NODE_RANK": "0", "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "ZERORUN_DEVICE": "cpu", "ZERORUN_BACKEND": "gloo",
        "ZERORUN_RANKS_PER_GPU": "1", "ZERORUN_PG_TIMEOUT": "42", "ZERORUN_RUN_ID": "rid", "ZERORUN_EVENT_FD": "9",
    }
    assert plan.defaults_env(0, {}) == {"OMP_NUM_THREADS": "4"}
    assert plan.defaults_env(0, {"OMP_NUM_THREADS": "3"}) == {}
    assert plan.target.shim_argv("py") == ["py", "-m", "zerorun.shim", "train.py", "--lr", "1"]
    assert Target(module="pkg.m", args=("a",)).shim_argv("py") == ["py", "-m", "zerorun.shim", "-m", "pkg.m", "a"]


def test_multi_node_plan() -> None:
    hosts = [Host("node1", (0, 1, 2, 3)), Host("node2", (0, 1, 2, 3))]
    gpus = DeviceInfo(gpus=("0", "1", "2", "3"), cores=8, driver_present=True)
    plan = plan_for(hosts, gpus, num_gpus=2, device="cuda")
    assert [(r.rank, r.local_rank, r.node_rank, r.host, r.gpu) for r in plan.ranks] == [
        (0, 0, 0, "node1", 0), (1, 1, 0, "node1", 1), (2, 0, 1, "node2", 0), (3, 1, 1, "node2", 1),
    ]
    assert plan.master_addr == "node1" and plan.backend == "nccl"
    assert plan.rank_env(plan.ranks[3])["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert plan.rank_env(plan.ranks[3])["GROUP_RANK"] == "1"
    assert plan.with_master("10.0.0.1").master_addr == "10.0.0.1"
    assert plan.omp_threads == {}  # remote nodes: their own core count decides (agent)


def test_visible_devices_and_rank_filter() -> None:
    assert parse_visible_devices(None) is None
    assert parse_visible_devices("") == ()
    assert parse_visible_devices("0,1,-1,2") == ("0", "1")
    assert parse_visible_devices(" GPU-ab12 ,MIG-x/1/2") == ("GPU-ab12", "MIG-x/1/2")
    assert parse_visible_devices("3,foo,4") == ("3",)
    assert parse_rank_filter(None, 4) is None
    assert parse_rank_filter("0, 2-3", 4) == {0, 2, 3}
    for bad in ("x", "3-1", "4"):
        with pytest.raises(LaunchError):
            parse_rank_filter(bad, 4)


def test_options_merge_keeps_the_command_line(tmp_path: Path) -> None:
    opts = LaunchOptions(target=TARGET, num_gpus=2)
    merged = opts.merged({"num_gpus": 8, "master_port": 1234, "hostfile": "hf", "ranks_per_gpu": 2}, base_dir=tmp_path)
    assert merged.num_gpus == 2 and merged.master_port == 1234 and merged.effective_ranks_per_gpu == 2
    assert merged.hostfile == str(tmp_path / "hf")
