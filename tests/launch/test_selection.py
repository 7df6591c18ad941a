"""--launcher auto/explicit: which launcher, and the reason the console prints."""

from __future__ import annotations

import pytest

from zerorun.errors import LaunchError
from zerorun.launch.selection import choose_launcher

STEP = {"SLURM_JOB_ID": "41", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2"}
ALLOC = {"SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2"}


@pytest.mark.parametrize(
    ("requested", "hostfile", "nnodes", "environ", "launcher", "why"),
    [
        (None, None, None, {}, "local", "this machine"),
        ("auto", "hosts", None, {}, "ssh", "--hostfile hosts"),
        (None, None, 2, {}, "pernode", "--nnodes 2"),
        (None, None, None, STEP, "pernode", "Slurm step 41.0 with 2 tasks"),
        (None, None, None, {**STEP, "SLURM_NTASKS": "1", "SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "0"}, "local", "one-task Slurm step"),
        (None, None, None, ALLOC, "slurm", "allocation 41 of 2 nodes"),
        (None, "hosts", None, ALLOC, "slurm", "--launcher ssh"),
        (None, None, None, {"SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1"}, "local", "this machine"),
        (None, None, None, {"PET_NNODES": "4", "WORLD_SIZE": "32"}, "pernode", "PET_NNODES=4"),
        ("ssh", "hosts", None, ALLOC, "ssh", "--launcher ssh"),
        ("SSH", "hosts", None, {}, "ssh", "--launcher ssh"),
        ("MPI", "hosts", None, {}, "mpi", "--launcher mpi"),
        ("slurm", None, None, ALLOC, "slurm", "--launcher slurm"),
        ("pernode", None, None, {}, "pernode", "--launcher pernode"),
    ],
)
def test_choose(requested, hostfile, nnodes, environ, launcher, why) -> None:
    choice = choose_launcher(requested, hostfile=hostfile, nnodes=nnodes, node_rank=None, environ=environ)
    assert choice.launcher == launcher
    assert why in choice.reason
    assert choice.line().startswith(f"launcher {launcher}: ")


@pytest.mark.parametrize(
    ("requested", "hostfile", "environ", "message"),
    [
        ("pdsh", None, {}, "not one of auto, local, ssh, slurm, mpi, pernode"),
        ("mpi", None, {}, "needs --hostfile"),
        ("slurm", None, {}, "SLURM_JOB_ID is not set"),
        ("ssh", None, {}, "needs --hostfile"),
        ("local", "hosts", {}, "this machine only"),
        (None, None, {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-"}, "SLURM_JOB_NODELIST"),
        (None, None, {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "x"}, "SLURM_NTASKS"),
    ],
)
def test_choose_errors(requested, hostfile, environ, message) -> None:
    with pytest.raises(LaunchError, match=message):
        choose_launcher(requested, hostfile=hostfile, nnodes=None, node_rank=None, environ=environ)
