"""Which cores zerorun's CPU kernel pins its pool to (runtime/offload/cpu_kernel.pool_cores):
never the ones the caller and the training thread run on, never cores another rank shares."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerorun.runtime.offload import cpu_kernel

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity")


def test_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv("ZERORUN_CPU_PIN", raising=False)
    allowed = sorted(os.sched_getaffinity(0))
    assert cpu_kernel.pool_cores(1) == (allowed[-1:] if len(allowed) > 1 else None)
    monkeypatch.setenv("ZERORUN_CPU_PIN", "0")
    assert cpu_kernel.pool_cores(1) is None


def test_the_last_cores_and_none_when_nothing_is_left(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZERORUN_CPU_PIN", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one core")
    assert cpu_kernel.pool_cores(len(allowed) - 1) == allowed[1:]
    assert cpu_kernel.pool_cores(len(allowed)) is None  # the caller would share a pinned core


def test_ranks_sharing_the_node_s_cores_pin_to_disjoint_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four ranks on a 16-core node with no affinity of their own (zerorun's launcher): each pins
    its pool to the last 3 of its 4 consecutive cores; no core is in two pools, and each slice's
    first core stays free."""
    monkeypatch.setenv("ZERORUN_CPU_PIN", "1")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    pools = []
    for rank in range(4):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        pools.append(cpu_kernel.pool_cores(3))
    assert pools == [[1, 2, 3], [5, 6, 7], [9, 10, 11], [13, 14, 15]]
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert cpu_kernel.pool_cores(4) is None  # a pool as large as the slice: no core left free
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # one core per rank: nothing to pin
    assert cpu_kernel.pool_cores(1) is None


def test_a_rank_with_its_own_affinity_pins_inside_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZERORUN_CPU_PIN", "1")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {8, 9, 10, 11})  # e.g. srun --cpu-bind
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert cpu_kernel.pool_cores(3) == [9, 10, 11]


_CHILD = r"""
import json, os, sys, torch
from zerorun.runtime.offload import cpu_kernel

k = cpu_kernel.load()
if k is None:
    print("no-kernel"); sys.exit(0)
n = 1 << 18

def step() -> bool:
    p, g, m, v = torch.ones(n), torch.full((n,), 0.5), torch.zeros(n), torch.zeros(n)
    k.step(p, g, m, v, step=1.0, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
           decoupled=True, maximize=False, threads=2)
    return bool(torch.allclose(p, torch.full((n,), 0.9)))

ok = step()
mine = sorted(os.sched_getaffinity(0))
pinned = []
for tid in os.listdir("/proc/self/task"):
    status = open(f"/proc/self/task/{tid}/status").read()
    line = [x for x in status.splitlines() if x.startswith("Cpus_allowed_list")][0]
    pinned.append(line.split(":")[1].strip())
p, g, m, v = torch.ones(n), torch.full((n,), 0.5), torch.zeros(n), torch.zeros(n)
pid = os.fork()
if pid == 0:  # the child has none of the pool's threads: the kernel makes them again
    # (no torch op of many elements here: torch's own OpenMP pool hangs in a fork child)
    k.step(p, g, m, v, step=1.0, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
           decoupled=True, maximize=False, threads=2)
    os._exit(0 if abs(p[0].item() - 0.9) < 1e-6 and abs(p[n - 1].item() - 0.9) < 1e-6 else 1)
_, status = os.waitpid(pid, 0)
print(json.dumps([ok, mine, sorted(pinned), os.waitstatus_to_exitcode(status)]))
"""


def test_the_pool_pins_its_threads_and_survives_fork(tmp_path: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one core")
    env = {**os.environ, "ZERORUN_CPU_PIN": "1", "LOCAL_WORLD_SIZE": "1", "ZERORUN_CACHE_DIR": str(tmp_path)}
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "no-kernel":
        pytest.skip("no C compiler here")
    ok, mine, pinned, child = json.loads(out.stdout.strip().splitlines()[-1])
    assert ok and child == 0
    # the pool's one helper thread on the first of the cores left for the pool (pool_cores: all
    # but the first); the caller (and the rest) keep every core
    first = str(allowed[1])
    assert mine == allowed and pinned.count(first) == 1, pinned
