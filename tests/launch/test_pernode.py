"""Per-node mode's parameters from the command line, PET_* (PyTorchJob), JOB_COMPLETION_INDEX
and a Slurm step: table-driven."""

from __future__ import annotations

from typing import Any

import pytest

from zerorun.errors import LaunchError
from zerorun.launch.pernode import DEFAULT_MASTER_PORT, resolve
from zerorun.launch.slurm_env import read_slurm_env


def spec(environ: dict[str, str] | None = None, **cli: Any):
    args: dict[str, Any] = dict(nnodes=None, node_rank=None, master_addr=None, master_port=None, rdzv_port=None,
                                nproc=None, rdzv_timeout=None)
    args.update(cli)
    env = environ or {}
    return resolve(**args, environ=env, slurm=read_slurm_env(env))


def test_command_line() -> None:
    s = spec(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=1234, nproc=4, rdzv_timeout=7)
    assert (s.nnodes, s.node_rank, s.master_addr, s.master_port, s.rdzv_port, s.nproc, s.rdzv_timeout) == (
        2, 1, "10.0.0.1", 1234, 1235, 4, 7.0)


def test_pytorchjob() -> None:
    env = {"PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_NPROC_PER_NODE": "auto", "PET_MASTER_ADDR": "job-master-0",
           "PET_MASTER_PORT": "23456", "WORLD_SIZE": "24", "MASTER_ADDR": "other", "MASTER_PORT": "1"}
    s = spec(env)
    assert (s.nnodes, s.node_rank, s.master_addr, s.master_port, s.nproc) == (3, 2, "job-master-0", 23456, None)
    assert "PET_NNODES=3" in s.source and "PET_NODE_RANK=2" in s.source


def test_command_line_beats_environment() -> None:
    s = spec({"PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "m"}, nnodes=2, node_rank=0, nproc=8)
    assert (s.nnodes, s.node_rank, s.nproc) == (2, 0, 8)


def test_indexed_job() -> None:
    s = spec({"JOB_COMPLETION_INDEX": "3", "MASTER_ADDR": "svc"}, nnodes=4)
    assert (s.node_rank, s.master_addr, s.master_port) == (3, "svc", DEFAULT_MASTER_PORT)


def test_pet_nnodes_fixed_range_and_nproc_number() -> None:
    s = spec({"PET_NNODES": "2:2", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": "4", "PET_MASTER_ADDR": "m"})
    assert (s.nnodes, s.nproc, s.master_addr) == (2, 4, "m")
    assert spec({"PET_NNODES": "1", "PET_NODE_RANK": "0"}).master_addr == "127.0.0.1"


def test_slurm_step() -> None:
    env = {"SLURM_JOB_ID": "4321", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_NNODES": "2",
           "SLURM_STEP_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_NODELIST": "gpu[07-08]",
           "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "1(x2)"}
    s = spec(env)
    assert (s.nnodes, s.node_rank, s.master_addr, s.master_port) == (2, 1, "gpu07", 20000 + 2 * 4321)


def test_slurm_step_with_a_task_per_gpu_is_an_error() -> None:
    env = {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NODEID": "0"}
    with pytest.raises(LaunchError, match="--ntasks-per-node=1"):
        spec(env)


@pytest.mark.parametrize(
    ("environ", "cli", "message"),
    [
        ({}, {}, "--nnodes N"),
        ({"WORLD_SIZE": "8"}, {}, "WORLD_SIZE is not used"),
        ({}, {"nnodes": 2}, "--node_rank R"),
        ({}, {"nnodes": 2, "node_rank": 2}, "not between 0 and 1"),
        ({}, {"nnodes": 2, "node_rank": 1}, "--master_addr"),
        ({"PET_NNODES": "1:4"}, {}, "elastic"),
        ({"PET_NNODES": "two"}, {}, "PET_NNODES"),
        ({"PET_NNODES": "2", "PET_NODE_RANK": "x"}, {}, "PET_NODE_RANK"),
        ({"JOB_COMPLETION_INDEX": "-1"}, {"nnodes": 2}, "JOB_COMPLETION_INDEX"),
        ({"PET_MASTER_PORT": "http"}, {"nnodes": 1, "node_rank": 0}, "PET_MASTER_PORT"),
        ({"PET_NPROC_PER_NODE": "0"}, {"nnodes": 1, "node_rank": 0}, "PET_NPROC_PER_NODE"),
        ({}, {"nnodes": 1, "node_rank": 0, "master_port": 5, "rdzv_port": 5}, "port of its own"),
        ({}, {"nnodes": 1, "node_rank": 0, "rdzv_timeout": 0}, "--rdzv_timeout"),
    ],
)
def test_errors(environ, cli, message) -> None:
    with pytest.raises(LaunchError, match=message):
        spec(environ, **cli)
