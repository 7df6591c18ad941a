"""Which rank am I and where is rank 0, under zerorun/torchrun, srun, mpirun or nothing (pure)."""

from __future__ import annotations

import pytest

from zerorun.errors import RuntimeConfigError
from zerorun.runtime.distributed import first_slurm_host, rank_env, rendezvous_address


def test_rank_env_sources() -> None:
    assert rank_env({}) == (0, 1, 0)
    assert rank_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}) == (3, 8, 1)
    assert rank_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}) == (5, 8, 1)
    assert rank_env(
        {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}
    ) == (
        2,
        4,
        2,
    )
    assert rank_env({"PMI_RANK": "1", "PMI_SIZE": "2"}) == (1, 2, 0)
    # torchrun's variables win over the scheduler's (torchrun inside an allocation).
    assert rank_env(
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "SLURM_PROCID": "7", "SLURM_NTASKS": "9"}
    ) == (
        0,
        2,
        0,
    )
    with pytest.raises(RuntimeConfigError, match="RANK"):
        rank_env({"RANK": "zero", "WORLD_SIZE": "2"})


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("gpu01", "gpu01"),
        ("gpu[03-04,07]", "gpu03"),
        ("gpu[12,15],cpu[1-2]", "gpu12"),
        ("a,b", "a"),
        ("n-1[2-3]", "n-12"),
    ],
)
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


def test_rendezvous_address() -> None:
    assert rendezvous_address({"MASTER_ADDR": "h", "MASTER_PORT": "1234"}, 4) == ("h", "1234")
    assert rendezvous_address({}, 1) == ("127.0.0.1", "29500")
    slurm = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "16",
        "SLURM_JOB_NODELIST": "node[07-08]",
        "SLURM_JOB_ID": "123456",
    }
    assert rendezvous_address(slurm, 16) == ("node07", str(20000 + 123456 % 20000))
    mpi_two_hosts = {"OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}
    with pytest.raises(RuntimeConfigError, match="MASTER_ADDR"):
        rendezvous_address(mpi_two_hosts, 16)
    assert rendezvous_address({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 4) == ("127.0.0.1", "29500")


def test_initialize_under_srun_variables(tmp_path) -> None:  # noqa: ANN001
    """Two real ranks with only srun's variables: process group, training, identical replicas."""
    from pathlib import Path

    from ._spawn import spawn_ranks

    out = tmp_path / "ok"
    spawn_ranks(
        Path(__file__).resolve().parent / "_slurm_worker.py", 2, [str(out)], deadline_s=120, style="slurm"
    )
    assert out.read_text() == "ok"
