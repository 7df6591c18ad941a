"""The plan takes each node's device from its preflight, not from the launcher's machine."""

from __future__ import annotations

import pytest

from zerorun.errors import LaunchError
from zerorun.launch.hosts import Host
from zerorun.launch.node_devices import adopt_node_devices
from zerorun.launch.plan import DeviceInfo, LaunchOptions, Target, build_plan

LOGIN_NODE = DeviceInfo(gpus=(), cores=4)  # a CPU-only launcher
WORKSTATION = DeviceInfo(gpus=("0", "1"), cores=8, driver_present=True)


def plan_for(devices: DeviceInfo, hosts: list[Host], **options):  # type: ignore[no-untyped-def]
    opts = LaunchOptions(target=Target(script="train.py"), **options)
    return build_plan(opts, hosts, devices, master_port=29500, run_id="r")


def test_cpu_launcher_with_gpu_nodes_plans_their_gpus() -> None:
    plan = plan_for(LOGIN_NODE, [Host("gpu1", (0, 1, 2, 3)), Host("gpu2", (0, 1, 2, 3))])
    assert (plan.device, plan.backend) == ("cpu", "gloo")  # the launcher's guess
    adopted = adopt_node_devices(plan, {"gpu1": 8, "gpu2": 8})
    assert (adopted.device, adopted.backend, adopted.world_size) == ("cuda", "nccl", 8)
    assert [n.visible_devices for n in adopted.nodes] == [("0", "1", "2", "3")] * 2
    assert [r.gpu for r in adopted.ranks] == [0, 1, 2, 3] * 2
    assert adopted.rank_env(adopted.ranks[5])["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_ranks_from_gpus_renumbers() -> None:
    plan = plan_for(LOGIN_NODE, [Host("n1", (0,)), Host("n2", (0,))])
    adopted = adopt_node_devices(plan, {"n1": 8, "n2": 4}, ranks_from_gpus=True)
    assert adopted.world_size == 12
    assert [(r.rank, r.node_rank, r.local_rank) for r in adopted.ranks][7:9] == [(7, 0, 7), (8, 1, 0)]
    assert adopted.nodes[1].visible_devices == ("0", "1", "2", "3")


def test_gpu_launcher_with_cpu_nodes_plans_cpu() -> None:
    plan = plan_for(WORKSTATION, [Host("c1", (0, 1)), Host("c2", (0, 1))])
    assert plan.device == "cuda"
    adopted = adopt_node_devices(plan, {"c1": 0, "c2": 0})
    assert (adopted.device, adopted.backend) == ("cpu", "gloo")
    assert all(n.visible_devices is None for n in adopted.nodes)
    assert "CUDA_VISIBLE_DEVICES" not in adopted.rank_env(adopted.ranks[0])


def test_same_device_is_unchanged() -> None:
    plan = plan_for(LOGIN_NODE, [Host("c1", (0, 1))])
    assert adopt_node_devices(plan, {"c1": 0}) is plan


@pytest.mark.parametrize(
    ("gpus", "message"),
    [
        ({"a": 8, "b": 0}, "some nodes have GPUs (a) and some have none (b)"),
    ],
)
def test_mixed_nodes_are_an_error(gpus, message) -> None:  # type: ignore[no-untyped-def]
    plan = plan_for(LOGIN_NODE, [Host("a", (0,)), Host("b", (0,))])
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        adopt_node_devices(plan, gpus)


def test_dry_run_says_probed_per_node(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from zerorun.launch.dry_run import format_dry_run
    from zerorun.launch.job import plan_job

    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("gpu1 slots=8\ngpu2 slots=8\n")
    monkeypatch.chdir(tmp_path)
    for key in [k for k in __import__("os").environ if k.startswith(("SLURM_", "PET_"))]:
        monkeypatch.delenv(key)
    probed = format_dry_run(plan_job(LaunchOptions(target=Target(script=str(script)), hostfile=str(hostfile), dry_run=True)).plan)
    assert "16 rank(s), 2 node(s), device per node, probed at start" in probed.splitlines()[0]
    fixed = format_dry_run(plan_job(LaunchOptions(target=Target(script=str(script)), hostfile=str(hostfile), dry_run=True,
                                                  device="cpu")).plan)
    assert "device cpu, backend gloo" in fixed.splitlines()[0]


def test_dry_run_names_the_launcher(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    env.update(SLURM_JOB_ID="12", SLURM_JOB_NODELIST="gpu[07-08]", SLURM_JOB_NUM_NODES="2", SLURM_TASKS_PER_NODE="4(x2)")
    proc = subprocess.run([sys.executable, "-m", "zerorun", "--dry-run", str(script)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("zerorun: launcher slurm: auto: inside Slurm allocation 12 of 2 nodes"), proc.stderr
    first = proc.stdout.splitlines()[0]
    assert "8 rank(s), 2 node(s), device per node, probed at start" in first, first
    assert "gpu08" in proc.stdout
