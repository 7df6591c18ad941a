"""runtime/pmix.py against a real PMIx server: Open MPI's mpirun on this machine (scripts/bootstrap.sh
--system installs it). Across two hosts: tests/multinode/test_schedulers.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Each rank: what the PMIx server says, and the torchrun variables the shim would export -- into a
# file of its own (mpirun forwards both ranks' stdout through one pipe, where a long line of one
# rank can be cut by the other's).
_PROBE = """
import json, os
from zerorun.runtime import pmix, world
job = pmix.job()
probe = {"env_rank": os.environ["PMIX_RANK"], "job": job.__dict__ if job else None,
         "torchrun": world.torchrun_env(os.environ)}
with open(os.path.join(os.environ["ZR_PROBE_DIR"], "rank-" + os.environ["PMIX_RANK"] + ".json"), "w") as f:
    json.dump(probe, f)
"""


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun (scripts/bootstrap.sh --system)")
def test_pmix_server_answers_under_mpirun(tmp_path: Path) -> None:
    argv = ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", "-x", "ZR_PROBE_DIR"]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env = {k: v for k, v in env.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env["ZR_PROBE_DIR"] = str(tmp_path)
    proc = subprocess.run([*argv, sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=60)
    # Exit 0: every rank finalized PMIx (Open MPI fails a job whose process exits initialized).
    assert proc.returncode == 0, proc.stdout + proc.stderr
    probes = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank-*.json"))]
    assert len(probes) == 2, (proc.stdout, proc.stderr)
    by_rank = {int(p["env_rank"]): p for p in probes}
    for rank, p in by_rank.items():
        job = p["job"]
        assert job == {"rank": rank, "size": 2, "local_rank": rank, "local_size": 2,
                       "rank0_host": socket.gethostname()}, p  # fmt: skip
        # One host: loopback; the port from the job's namespace, the same on both ranks.
        t = p["torchrun"]
        assert (t["RANK"], t["WORLD_SIZE"], t["LOCAL_RANK"], t["LOCAL_WORLD_SIZE"]) == (str(rank), "2", str(rank), "2")
        assert t["MASTER_ADDR"] == "127.0.0.1"
    assert by_rank[0]["torchrun"]["MASTER_PORT"] == by_rank[1]["torchrun"]["MASTER_PORT"] != "29500"


def test_a_library_without_pmix_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """ZERORUN_PMIX_LIBRARY naming a library that is not libpmix (here the C library) is skipped
    like a missing one: no AttributeError out of the shim in every rank."""
    import ctypes

    from zerorun.runtime import pmix

    monkeypatch.setenv("ZERORUN_PMIX_LIBRARY", "libc.so.6")
    monkeypatch.setattr(pmix.ctypes.util, "find_library", lambda name: None)
    tried: list[str] = []
    real_cdll = ctypes.CDLL

    def cdll(name: str) -> ctypes.CDLL:
        tried.append(name)
        if name != "libc.so.6":
            raise OSError(f"{name}: not here")  # no system libpmix either
        return real_cdll(name)

    monkeypatch.setattr(pmix.ctypes, "CDLL", cdll)
    assert pmix._library() is None
    assert tried[0] == "libc.so.6"
    monkeypatch.setattr(pmix, "_cache", {})
    assert pmix.job({"PMIX_NAMESPACE": "job1", "PMIX_RANK": "0"}) is None
