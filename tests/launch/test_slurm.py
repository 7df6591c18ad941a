"""The srun command the Slurm launcher runs, and the allocation's hosts (pure parts)."""

from __future__ import annotations

import pytest

from zerorun.errors import LaunchError
from zerorun.launch.dialin import local_addresses
from zerorun.launch.slurm import allocation_hosts, srun_command
from zerorun.launch.slurm_env import read_slurm_env


def test_srun_command() -> None:
    argv = srun_command(["gpu01", "gpu02", "gpu03", "gpu07"], python="/opt/py/bin/python", cwd="/work dir", in_step=False)
    assert argv == [
        "srun", "--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "--cpu-bind=none", "--kill-on-bad-exit=1",
        "--nodelist=gpu[01-03,07]", "--chdir=/work dir", "--job-name=zerorun-agents",
        "/opt/py/bin/python", "-u", "-m", "zerorun.launch.agent", "--dial",
    ]


def test_srun_command_inside_a_step_and_passthrough() -> None:
    argv = srun_command(["n1", "n2"], python="py", cwd="/", in_step=True, slurm_args="--partition gpu --comment 'two words'")
    head = argv[: argv.index("py")]
    assert "--overlap" in head
    assert head[-4:] == ["--partition", "gpu", "--comment", "two words"]  # after ours: the user's win
    assert argv[-4:] == ["-u", "-m", "zerorun.launch.agent", "--dial"]


def test_srun_command_bad_passthrough() -> None:
    with pytest.raises(LaunchError, match="--slurm_args"):
        srun_command(["n1"], python="py", cwd="/", in_step=False, slurm_args="--comment 'open")


def test_allocation_hosts() -> None:
    env = read_slurm_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "4(x2),2",
                          "SLURM_JOB_CPUS_PER_NODE": "64(x3)"})
    assert [(h.name, len(h.slots)) for h in allocation_hosts(env, num_gpus=None)] == [("n1", 4), ("n2", 4), ("n3", 2)]
    assert [len(h.slots) for h in allocation_hosts(env, num_gpus=8, k=2)] == [4, 4, 4]  # --num_gpus wins
    bare = read_slurm_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert [len(h.slots) for h in allocation_hosts(bare, num_gpus=None)] == [1, 1]
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST is not set"):
        allocation_hosts(read_slurm_env({"SLURM_JOB_ID": "7"}), num_gpus=None)


def test_local_addresses() -> None:
    addrs = local_addresses()
    assert "127.0.0.1" in addrs and addrs[-1].startswith("127.")


def test_mpirun_command() -> None:
    from zerorun.launch.mpi import mpirun_command

    argv = mpirun_command(["node1", "node2"], python="/py", cwd="/w", mpi_args="--mca btl self,tcp", as_root=True,
                          forward=["PYTHONPATH"])
    assert argv[:10] == ["mpirun", "-np", "2", "--map-by", "ppr:1:node", "-H", "node1:1,node2:1", "--bind-to", "none", "-wdir"]
    assert "--allow-run-as-root" in argv
    assert " ".join(argv).count("-x ") == 3 and "ZERORUN_AGENT_TOKEN" in argv  # the name, never the value
    assert argv[-8:] == ["--mca", "btl", "self,tcp", "/py", "-u", "-m", "zerorun.launch.agent", "--dial"]
    with pytest.raises(LaunchError, match="--mpi_args"):
        mpirun_command(["n"], python="p", cwd="/", mpi_args="'")


def test_salloc_command() -> None:
    from zerorun.launch.slurm import salloc_command

    inner = ["/py", "-m", "zerorun", "--launcher", "slurm", "--num_nodes", "4", "train.py"]
    assert salloc_command(num_nodes=4, gpus_per_node=8, slurm_args="-p gpu -t 1:00:00", inner=inner) == [
        "salloc", "--nodes=4", "--gpus-per-node=8", "--ntasks-per-node=8", "-p", "gpu", "-t", "1:00:00", *inner,
    ]
    assert salloc_command(num_nodes=2, gpus_per_node=None, slurm_args=None, inner=["x"]) == ["salloc", "--nodes=2", "x"]
    with pytest.raises(LaunchError, match="--num_nodes N"):
        salloc_command(num_nodes=None, gpus_per_node=None, slurm_args=None, inner=["x"])
