"""Which rank, and where rank 0 is, under each launcher's variables (pure; the PMIx server is a
stand-in here: tests/multinode/test_schedulers.py asks a real one across two fake hosts)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from zerorun.errors import RuntimeConfigError
from zerorun.runtime.pmix import PmixJob
from zerorun.runtime.world import World, rendezvous_address, torchrun_env, world

# What Open MPI 4.1 (ORTE) exports to rank 1 of `mpirun -H a:2,b:2 -np 4` (PMIx variables trimmed).
OMPI_RANK1 = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "PMIX_NAMESPACE": "512163841",
    "PMIX_RANK": "1",
}
# What PRRTE's `prterun` (Open MPI 5 without its MPI personality) leaves: rank and namespace only.
PRRTE_RANK3 = {"PMIX_NAMESPACE": "prterun-a-4242@1", "PMIX_RANK": "3"}


class FakeServer:
    """Stands in for `pmix.job`: what a PMIx server would answer, and how often it was asked."""

    def __init__(self, job: PmixJob | None) -> None:
        self.job = job
        self.asked = 0

    def __call__(self, env: Mapping[str, str]) -> PmixJob | None:
        self.asked += 1
        return self.job


def never(env: Mapping[str, str]) -> PmixJob | None:
    raise AssertionError("the PMIx server must not be asked here")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, World(0, 1, 0, None, "none")),
        ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, World(3, 8, 1, 4, "torchrun")),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}, World(5, 8, 1, None, "slurm")),
        (OMPI_RANK1, World(1, 4, 1, 2, "openmpi")),
        ({"PMIX_RANK": "6", "PMIX_SIZE": "8", "PMIX_LOCAL_RANK": "2", "PMIX_LOCAL_SIZE": "4"}, World(6, 8, 2, 4, "pmix")),
        ({"PMI_RANK": "1", "PMI_SIZE": "2"}, World(1, 2, 0, None, "pmi")),
        ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, World(3, 4, 1, 2, "pmi")),
        ({"PMI_RANK": "3", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "2"}, World(3, 4, 1, 2, "pmi")),
        # torchrun inside an allocation or an mpirun: torchrun's variables win.
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", **OMPI_RANK1}, World(0, 2, 0, None, "torchrun")),
    ],
)
def test_world_from_each_launcher(env: dict[str, str], expected: World) -> None:
    assert world(env, never) == expected


def test_pmix_server_fills_in_what_the_environment_lacks() -> None:
    server = FakeServer(PmixJob(rank=3, size=4, local_rank=1, local_size=2, rank0_host="a"))
    assert world(PRRTE_RANK3, server) == World(3, 4, 1, 2, "pmix")
    # No server to ask (no libpmix, or it refused): a single process, as before.
    assert world(PRRTE_RANK3, FakeServer(None)) == World(0, 1, 0, None, "none")
    with pytest.raises(RuntimeConfigError, match=r"OMPI_COMM_WORLD_RANK='one' is not an integer"):
        world({**OMPI_RANK1, "OMPI_COMM_WORLD_RANK": "one"}, never)


def test_master_of_a_multi_host_mpirun_is_rank0s_host() -> None:
    server = FakeServer(PmixJob(rank=1, size=4, local_rank=1, local_size=2, rank0_host="node1"))
    addr, port = rendezvous_address(OMPI_RANK1, 4, server)
    # Every rank derives the same port from the job's namespace: concurrent jobs do not collide.
    assert (addr, port) == ("node1", str(20000 + 512163841 % 20000))
    # Open MPI 5 names its namespaces: a port from their checksum, the same on every rank.
    prrte = FakeServer(PmixJob(rank=3, size=4, local_rank=1, local_size=2, rank0_host="a"))
    addr, port = rendezvous_address(PRRTE_RANK3, 4, prrte)
    assert addr == "a" and 20000 <= int(port) < 40000
    assert rendezvous_address(PRRTE_RANK3, 4, prrte) == (addr, port)
    # MASTER_ADDR / MASTER_PORT exported by the user win, and the server is not asked.
    assert rendezvous_address({**OMPI_RANK1, "MASTER_ADDR": "h", "MASTER_PORT": "1234"}, 4, never) == ("h", "1234")
    # One host: loopback, without asking.
    one_host = {**OMPI_RANK1, "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert rendezvous_address(one_host, 4, never) == ("127.0.0.1", str(20000 + 512163841 % 20000))


def test_master_unknown_is_a_clear_error() -> None:
    with pytest.raises(RuntimeConfigError, match=r"PMIx server could not tell rank 0's host: export MASTER_ADDR"):
        rendezvous_address(OMPI_RANK1, 4, FakeServer(None))
    mpich = {"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    with pytest.raises(RuntimeConfigError, match=r"several hosts but MASTER_ADDR is not set: export MASTER_ADDR"):
        rendezvous_address(mpich, 4, never)


def test_torchrun_variables_for_a_script_under_mpirun() -> None:
    server = FakeServer(PmixJob(rank=1, size=4, local_rank=1, local_size=2, rank0_host="node1"))
    assert torchrun_env(OMPI_RANK1, server) == {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": str(20000 + 512163841 % 20000),
    }
    # Under zerorun or torchrun, or a single process: nothing to add.
    assert torchrun_env({"RANK": "0", "WORLD_SIZE": "2", **OMPI_RANK1}, never) == {}
    assert torchrun_env({}, never) == {}
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "n[3-4]",
             "SLURM_JOB_ID": "77"}
    assert torchrun_env(slurm, never) == {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "n3", "MASTER_PORT": "20077",
    }  # fmt: skip


# Rank 1 of `salloc -N2 --ntasks-per-node=2 mpirun -np 4 ...` (Open MPI 4.1 under Slurm 22.05, as
# printed by a rank on the test machine's Slurm): mpirun started its daemons with srun, so the
# ranks carry the daemon's SLURM_PROCID/SLURM_NTASKS (node index, node count).
OMPI_IN_SALLOC = {**OMPI_RANK1, "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
                  "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "node[1-2]"}  # fmt: skip


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (OMPI_IN_SALLOC, World(1, 4, 1, 2, "openmpi")),
        # MPICH's hydra inside an allocation: rank 0 shares SLURM_PROCID 0 with its proxy, not the size.
        ({"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "SLURM_PROCID": "0",
          "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, World(0, 4, 0, 2, "pmi")),
        # srun --mpi=pmi2 / --mpi=pmix started the ranks themselves: Slurm's variables, SLURM_LOCALID included.
        ({"PMI_RANK": "3", "PMI_SIZE": "4", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1"},
         World(3, 4, 1, None, "slurm")),
        ({"PMIX_RANK": "3", "PMIX_NAMESPACE": "slurm.pmix.77.0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
          "SLURM_LOCALID": "1"}, World(3, 4, 1, None, "slurm")),
    ],
)  # fmt: skip
def test_the_innermost_launcher_wins_over_slurm(env: dict[str, str], expected: World) -> None:
    assert world(env, never) == expected


def test_mpirun_inside_an_allocation_finds_rank0_through_pmix() -> None:
    server = FakeServer(PmixJob(rank=1, size=4, local_rank=1, local_size=2, rank0_host="node1"))
    # Not Slurm's first node and job-id port: rank 0's host from PMIx, the port from the namespace.
    assert rendezvous_address(OMPI_IN_SALLOC, 4, server) == ("node1", str(20000 + 512163841 % 20000))
    # PRRTE inside an allocation (rank 0 on the first node: SLURM_PROCID 0 too): the PMIx server.
    prrte = {**PRRTE_RANK3, "PMIX_RANK": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    job0 = FakeServer(PmixJob(rank=0, size=4, local_rank=0, local_size=2, rank0_host="node1"))
    assert world(prrte, job0) == World(0, 4, 0, 2, "pmix")
