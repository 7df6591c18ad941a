"""Slurm host lists and SLURM_* variables: table-driven, including malformed values."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from zerorun.errors import LaunchError
from zerorun.launch.slurm_env import compress_hostlist, expand_counts, expand_hostlist, read_slurm_env

HOSTLISTS = [
    ("node1", ["node1"]),
    ("gpu[01-04,07],cpu-a[1-2]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu-a1", "cpu-a2"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("n[0-2]", ["n0", "n1", "n2"]),
    ("n[00-02]", ["n00", "n01", "n02"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("a[1-2]b[1]", ["a1b1", "a2b1"]),
    ("n[01-10]", ["n01", "n02", "n03", "n04", "n05", "n06", "n07", "n08", "n09", "n10"]),
    ("h1,h2,h1", ["h1", "h2", "h1"]),
    ("a.b-c_d[7]", ["a.b-c_d7"]),
    ("x[5]", ["x5"]),
    ("node[1-2],node[4-5]", ["node1", "node2", "node4", "node5"]),
]


@pytest.mark.parametrize(("text", "hosts"), HOSTLISTS)
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("gpu[01-04", "never closed"),
        ("gpu01-04]", "has no '['"),
        ("gpu[[1-2]]", "cannot nest"),
        ("gpu[4-1]", "backwards"),
        ("gpu[a-b]", "not a number"),
        ("gpu[]", "empty"),
        ("gpu[1-2],,cpu1", "empty entry"),
        ("gpu[1-2],", "empty entry"),
        ("gpu 1", "not part of a host name"),
        ("g$(x)[1]", "not part of a host name"),
        ("n[1-9999999]", "more than"),
        ("n[1-2:2]", "not a number"),
        ("a[1,3]b", "follows the last ']'"),
        ("[1-2]x", "follows the last ']'"),
    ],
)
def test_expand_hostlist_malformed(text: str, why: str) -> None:
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST") as err:
        expand_hostlist(text, source="SLURM_JOB_NODELIST")
    assert why in str(err.value)


@pytest.mark.parametrize(("text", "hosts"), HOSTLISTS)
def test_compress_round_trip(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(compress_hostlist(hosts)) == hosts


def test_compress_merges_runs() -> None:
    assert compress_hostlist(["gpu01", "gpu02", "gpu03", "gpu07", "cpu-a1", "cpu-a2", "login"]) == (
        "gpu[01-03,07],cpu-a[1-2],login"
    )


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol comes with Slurm (bootstrap.sh --system, CI)")
def test_matches_scontrol(tmp_path: Path) -> None:
    """The real `scontrol show hostnames` agrees on every valid case, and refuses the text-after-
    a-range form we refuse (it needs only a slurm.conf to parse, no daemon)."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=n1\nPartitionName=p Nodes=n1\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for text, hosts in HOSTLISTS:
        out = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True, timeout=10, env=env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == hosts == expand_hostlist(text), text
    for bad in ("a[1,3]b", "[1-2]x", "n[1-2:2]"):
        out = subprocess.run(["scontrol", "show", "hostnames", bad], capture_output=True, text=True, timeout=10, env=env)
        assert not out.stdout.split(), (bad, out.stdout)


@pytest.mark.parametrize(
    ("text", "counts"),
    [
        ("8", [8]),
        ("8(x4),4", [8, 8, 8, 8, 4]),
        ("2(x1)", [2]),
        ("1,2,3", [1, 2, 3]),
        (" 4(x2) , 1 ", [4, 4, 1]),
    ],
)
def test_expand_counts(text: str, counts: list[int]) -> None:
    assert expand_counts(text) == counts


@pytest.mark.parametrize("text", ["", "x", "8(4)", "8(x)", "8(x0)", "8(x2", "-1", "8,,2", "8(x2)(x2)"])
def test_expand_counts_malformed(text: str) -> None:
    with pytest.raises(LaunchError, match="SLURM_TASKS_PER_NODE"):
        expand_counts(text)


def test_read_allocation() -> None:
    env = read_slurm_env(
        {
            "SLURM_JOB_ID": "77",
            "SLURM_JOB_NODELIST": "gpu[01-02]",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_TASKS_PER_NODE": "4(x2)",
        }
    )
    assert env.in_allocation and not env.in_step
    assert env.nodes == ("gpu01", "gpu02") and env.num_nodes == 2 and env.tasks_per_node == (4, 4)


def test_read_step() -> None:
    env = read_slurm_env(
        {
            "SLURM_JOB_ID": "77",
            "SLURM_STEP_ID": "0",
            "SLURM_NODELIST": "n[1-3]",
            "SLURM_STEP_NODELIST": "n[1-2]",
            "SLURM_STEP_NUM_NODES": "2",
            "SLURM_NNODES": "3",
            "SLURM_NTASKS": "2",
            "SLURM_NODEID": "1",
            "SLURM_PROCID": "1",
            "SLURM_TASKS_PER_NODE": "1(x2)",
        }
    )
    assert env.in_step and env.node_id == 1 and env.ntasks == 2 and env.step_nodes == ("n1", "n2")


def test_batch_step_is_not_a_step() -> None:
    assert not read_slurm_env({"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "batch"}).in_step
    assert read_slurm_env({}).in_allocation is False


@pytest.mark.parametrize(
    ("environ", "name"),
    [
        ({"SLURM_JOB_NODELIST": "n[1-"}, "SLURM_JOB_NODELIST"),
        ({"SLURM_NODELIST": "n[2-1]"}, "SLURM_NODELIST"),
        ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "3"}, "SLURM_JOB_NUM_NODES"),
        ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "4(x3)"}, "SLURM_TASKS_PER_NODE"),
        ({"SLURM_TASKS_PER_NODE": "four"}, "SLURM_TASKS_PER_NODE"),
        ({"SLURM_NTASKS": "two"}, "SLURM_NTASKS"),
        ({"SLURM_NTASKS": "0"}, "SLURM_NTASKS"),
        ({"SLURM_NODEID": "-1"}, "SLURM_NODEID"),
        ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "2"}, "SLURM_NODEID"),
        ({"SLURM_STEP_NODELIST": "a,,b"}, "SLURM_STEP_NODELIST"),
    ],
)
def test_read_malformed_names_variable(environ: dict[str, str], name: str) -> None:
    with pytest.raises(LaunchError, match=name):
        read_slurm_env(environ)
