"""bf16 gradients on the host (options.narrow_grads) and the one-pass CPU Adam kernel that widens
them (runtime/offload/cpu_kernel.py): the kernel against torch's fused CPU Adam(W), the rule that
decides when a gradient is exactly bf16, and whole offloaded runs with and without the kernel."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from zerorun.config import load_config
from zerorun.runtime.offload import cpu_kernel
from zerorun.runtime.offload.options import grads_are_bf16
from zerorun.runtime.settings import settings_from_config

from ._spawn import spawn_ranks

HERE = Path(__file__).resolve().parent


def _kernel() -> cpu_kernel.AdamKernel:
    cpu_kernel.reset()
    k = cpu_kernel.load()
    if k is None:
        if os.environ.get("CI"):
            pytest.fail("the CPU Adam kernel did not build: scripts/bootstrap.sh --system installs gcc")
        pytest.skip("no C compiler here")
    return k


def _torch_step(p, g, m, v, step, decoupled, maximize, wd):  # noqa: ANN001, ANN202
    fn = torch._fused_adamw_ if decoupled else torch._fused_adam_
    fn([p], [g.float()], [m], [v], [], [torch.tensor(float(step))], amsgrad=False, lr=1e-3, beta1=0.9,
       beta2=0.999, weight_decay=wd, eps=1e-8, maximize=maximize, grad_scale=None, found_inf=None)


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("maximize", [False, True], ids=["min", "max"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("step", [1, 1000])
@pytest.mark.parametrize("gdtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mode", ["threads", "omp"])
def test_kernel_is_torchs_fused_adam_bit_for_bit(
    decoupled: bool, maximize: bool, wd: float, step: int, gdtype: torch.dtype, mode: str
) -> None:
    """Same operation order as torch's fused CPU kernel: bitwise equal on the elements of its
    vector loop (n a multiple of 64), at most one ulp on its scalar tail (odd n); split over the
    pool (chunks of 32768 elements claimed by 3 threads) or one OpenMP region alike."""
    k = _kernel()
    k.mode = mode
    for n, exact in ((1 << 17, True), ((1 << 17) + 13, False)):
        torch.manual_seed(n + step)
        p, g = torch.randn(n), torch.randn(n).to(gdtype)
        m, v = torch.randn(n) * 0.1, torch.rand(n) * 0.01
        a, b = [t.clone() for t in (p, m, v)], [t.clone() for t in (p, m, v)]
        k.step(a[0], g, a[1], a[2], step=float(step), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
               weight_decay=wd, decoupled=decoupled, maximize=maximize, threads=3)
        _torch_step(b[0], g, b[1], b[2], step, decoupled, maximize, wd)
        for x, y in zip(a, b, strict=True):
            if exact:
                assert torch.equal(x, y)
            else:
                ulp = torch.finfo(torch.float32).eps * y.abs().clamp_min(1e-30)
                assert ((x - y).abs() <= ulp).all() and (x != y).sum() <= 13


def test_kernel_rejects_wrong_tensors() -> None:
    k = _kernel()
    p = torch.zeros(8)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        k.step(p, torch.zeros(8, dtype=torch.float16), p.clone(), p.clone(), step=1.0, lr=1.0, beta1=0.9,
               beta2=0.9, eps=1e-8, weight_decay=0.0, decoupled=True, maximize=False, threads=1)
    with pytest.raises(ValueError, match="contiguous"):
        k.step(p, torch.zeros(16)[::2], p.clone(), p.clone(), step=1.0, lr=1.0, beta1=0.9,
               beta2=0.9, eps=1e-8, weight_decay=0.0, decoupled=True, maximize=False, threads=1)


def test_disabled_kernel_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZERORUN_CPU_KERNEL", "0")
    cpu_kernel.reset()
    assert cpu_kernel.load() is None
    monkeypatch.delenv("ZERORUN_CPU_KERNEL")
    cpu_kernel.reset()


def test_cache_dir_that_cannot_be_written_means_no_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("ZERORUN_CACHE_DIR", str(tmp_path / "file"))  # a file: no directory under it
    cpu_kernel.reset()
    assert cpu_kernel.load() is None
    monkeypatch.delenv("ZERORUN_CACHE_DIR")
    cpu_kernel.reset()


@pytest.mark.parametrize(
    ("cfg", "world", "expect"),
    [
        ({"bf16": {"enabled": True}}, 1, True),  # one rank, one micro-step, no clipping
        ({"bf16": {"enabled": True}, "gradient_clipping": 1.0}, 1, False),  # clipped: scaled
        ({"bf16": {"enabled": True}, "gradient_accumulation_steps": 2}, 1, False),  # a sum
        ({"bf16": {"enabled": True}}, 2, False),  # the reduction sums ranks
        ({"bf16": {"enabled": True}, "communication_data_type": "bf16"}, 2, True),  # reduced in bf16
        ({"bf16": {"enabled": True}, "communication_data_type": "bf16", "gradient_clipping": 1.0}, 4, True),
        ({}, 1, False),  # fp32 training
        ({"fp16": {"enabled": True}}, 1, False),
    ],
)
def test_which_gradients_are_exactly_bf16(cfg: dict, world: int, expect: bool) -> None:
    base = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    settings = settings_from_config(load_config({**base, **cfg}).config, world_size=world)
    assert grads_are_bf16(settings) is expect


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("narrow") / "narrow.json"
    spawn_ranks(HERE / "_narrow_worker.py", 1, [str(out)], deadline_s=240)
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "name",
    ["z1-bf16-ga1-clip0-opt-cpu-wide", "z2-bf16-ga1-clip0-opt-cpu-wide", "z2-bf16-ga1-clip0-opt-cpu-adam_l2-wide",
     "z2-bf16-ga1-clip0-opt-cpu-sgd-wide", "z3-bf16-ga1-clip0-opt-cpu-wide",
     "z3-bf16-ga1-clip0-opt-cpu-param-cpu-wide", "z2-bf16-ga1-clip0-opt-cpu-dpu1-wide"],
)
def test_bf16_wire_trains_as_the_fp32_wire(runs: dict, name: str) -> None:
    """The same run with bf16 gradients on the wire (the kernel) and with fp32 ones (torch's
    kernel): the gradient is the same number either way and the kernels compute alike, so
    losses and masters are bitwise equal (the tiles here are 1024 elements: no scalar tail)."""
    _kernel()
    r = runs[name]
    assert r["wire"] == [["torch.bfloat16"], ["torch.float32"]], r["wire"]
    assert r["losses"][0] == r["losses"][1]
    assert r["bitwise"], r["master_diff"]


def test_kernel_serves_concurrent_callers() -> None:
    """Two workers (two engines in one process) stepping at once, with different thread counts:
    each gets torch's numbers."""
    from concurrent.futures import ThreadPoolExecutor

    k = _kernel()
    k.mode = "threads"
    n = 1 << 18

    def one(threads: int) -> bool:
        torch.manual_seed(threads)
        p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
        b = [t.clone() for t in (p, m, v)]
        for step in range(1, 6):
            k.step(p, g, m, v, step=float(step), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                   decoupled=True, maximize=False, threads=threads)
            _torch_step(b[0], g, b[1], b[2], step, True, False, 0.1)
        return all(torch.equal(x, y) for x, y in zip((p, m, v), b, strict=True))

    with ThreadPoolExecutor(2) as pool:
        assert all(pool.map(one, [3, 4, 3, 4]))


def test_ranks_of_one_node_build_the_kernel_at_once(tmp_path: Path) -> None:
    """Four processes with an empty cache start at the same moment (the ranks of one node): each
    gets a working kernel, and the cache holds one whole library, no temporary files."""
    import subprocess
    import sys

    _kernel()
    code = (
        "import torch; from zerorun.runtime.offload import cpu_kernel; k = cpu_kernel.load(); "
        "p = torch.zeros(4); k.step(p, torch.ones(4), torch.zeros(4), torch.zeros(4), step=1.0, lr=0.1, "
        "beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, maximize=False, threads=1); "
        "print(p.tolist())"
    )
    env = {**os.environ, "ZERORUN_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outs)) == 1 and outs[0].startswith("[-0.0999")  # Adam's first step: -lr * sign(grad)
    files = sorted(f.name for f in (tmp_path / "kernels").iterdir())
    assert len(files) == 1 and files[0].endswith(".so"), files
