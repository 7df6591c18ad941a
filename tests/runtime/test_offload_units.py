"""Offload pieces in one process: options, thread sizing, the NVMe file layer (direct I/O and the
buffered fallback), the tile kernel against torch's optimizer, the config warning."""

from __future__ import annotations

import errno
import os
import warnings

import pytest
import torch

from zerorun.config import load_config
from zerorun.errors import ConfigError
from zerorun.runtime.offload import adam, nvme
from zerorun.runtime.offload.host import tiles
from zerorun.runtime.offload.options import cores_per_rank, options_from_settings, rank_cores
from zerorun.runtime.settings import RuntimeSettings, settings_from_config


def _settings(zero: dict, extra: dict | None = None, clip: float = 1.0, fp16: bool = False) -> RuntimeSettings:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": zero,
        "zerorun": extra or {},
        "gradient_clipping": clip,
        "fp16": {"enabled": fp16},
    }
    return settings_from_config(load_config(cfg).config, world_size=1)


def test_options_resolve_deepspeed_and_zerorun_keys() -> None:
    o = options_from_settings(
        _settings(
            {
                "stage": 2,
                "sub_group_size": 5000,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "pin_memory": True, "buffer_count": 6},
            },
            {"delayed_param_update": True, "delayed_param_update_warmup": 3, "offload_cpu_threads": 5},
        )
    )
    assert (o.optimizer_device, o.nvme_path, o.pin_memory, o.buffer_count) == ("nvme", "/x", True, 6)
    assert (o.delayed_update, o.delayed_warmup, o.step_threads(), o.cpu_tile) == (True, 3, 5, 5000)
    # no effect where the config loader already warned: param offload below stage 3, DPU without a CPU step
    o = options_from_settings(
        _settings({"stage": 2, "offload_param": {"device": "cpu"}}, {"delayed_param_update": True})
    )
    assert (o.param_device, o.delayed_update) == ("none", False)


def test_nvme_without_path_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="offload_optimizer.device = 'nvme' needs zero_optimization.offload_optimizer.nvme_path"):
        _settings({"stage": 1, "offload_optimizer": {"device": "nvme"}})


def test_offload_tiles_need_an_element() -> None:
    with pytest.raises(ConfigError, match="sub_group_size = 0: the optimizer step"):
        _settings({"stage": 1, "sub_group_size": 0, "offload_optimizer": {"device": "cpu"}})
    assert _settings({"stage": 1, "sub_group_size": 0}).offload.sub_group_size == 0  # no offload: no tiles


def test_offload_below_its_stage_reads_none() -> None:
    """config/rules.py's rule, applied once when the settings are built (the loader warned)."""
    s = _settings({"stage": 0, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}})
    assert (s.offload.optimizer_device, s.offload.param_device, s.offload.enabled) == ("none", "none", False)
    s = _settings({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}})
    assert (s.offload.optimizer_device, s.offload.param_device, s.offload.enabled) == ("cpu", "cpu", True)


def test_cpu_threads_share_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cores_per_rank() == 4 and rank_cores() == [4, 5, 6, 7]  # the node's cores, shared: a slice
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {8, 9, 10, 11, 12, 13}, raising=False)
    assert rank_cores() == [8, 9, 10, 11, 12, 13]  # an affinity of its own (srun --cpu-bind): all of it
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    o = options_from_settings(_settings({"stage": 2, "offload_optimizer": {"device": "cpu"}}))
    assert o.step_threads() == 4 and not o.early_start  # clipping: the step waits for the norm
    o = options_from_settings(_settings({"stage": 2, "offload_optimizer": {"device": "cpu"}}, clip=0.0))
    assert o.early_start and o.step_threads() == 3  # the step overlaps backward: a core for the loop
    o = options_from_settings(
        _settings({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, clip=0.0)
    )
    assert o.early_start and o.step_threads() == 3  # and the next forward: a core for it
    o = options_from_settings(_settings({"stage": 2, "offload_optimizer": {"device": "cpu"}}, clip=0.0, fp16=True))
    assert not o.early_start  # fp16 steps depend on the overflow check
    o = options_from_settings(
        _settings({"stage": 2, "offload_optimizer": {"device": "cpu"}}, {"delayed_param_update": True})
    )
    assert o.step_threads() == 3  # one core left to the training loop


def test_tiles_cover_the_shard() -> None:
    assert tiles(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert tiles(8, 8) == [(0, 8)]


def test_delayed_update_without_offload_warns_in_the_config() -> None:
    loaded = load_config({"train_micro_batch_size_per_gpu": 1, "zerorun": {"delayed_param_update": True}})
    assert any("delayed_param_update" in w and "offload_optimizer" in w for w in loaded.warnings)


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_tile_kernel_equals_torch_fused_step(cls: type, amsgrad: bool) -> None:
    """Stepping a master in tiles (state keys and types as torch's) == torch's fused step."""
    torch.manual_seed(0)
    p0 = torch.randn(1000)
    ref = p0.clone().requires_grad_(True)
    opt_ref = cls([ref], lr=0.01, weight_decay=0.1, amsgrad=amsgrad, fused=True)
    mine = p0.clone()
    opt = cls([mine], lr=0.01, weight_decay=0.1, amsgrad=amsgrad)
    for step in range(3):
        g = torch.randn(1000, generator=torch.Generator().manual_seed(step))
        ref.grad = g.clone()
        opt_ref.step()
        assert adam.supports_tiles(opt)
        h = adam.hyper_of(opt, opt.param_groups[0])
        state = adam.ensure_state(opt, mine, h)
        state["step"] += 1
        for a, b in tiles(1000, 96):
            adam.adam_tile(
                mine[a:b], g[a:b], state["exp_avg"][a:b], state["exp_avg_sq"][a:b],
                state["max_exp_avg_sq"][a:b] if amsgrad else None, state["step"], h,
            )
    assert torch.equal(mine, ref.detach())
    assert set(opt.state[mine]) == set(opt_ref.state[ref])
    assert not adam.supports_tiles(torch.optim.SGD([torch.zeros(1)], lr=0.1))


def test_nvme_files_direct_or_buffered(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Where O_DIRECT is refused (tmpfs, some container filesystems) the file layer falls back to
    buffered I/O, says so once, and reads/writes the same bytes; its directory goes on close."""
    real_open = os.open

    def no_direct(path, flags, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(nvme, "_buffered_warned", False)
    for refuse in (False, True):
        if refuse:
            monkeypatch.setattr(os, "open", no_direct)
        files = nvme.TileFiles(str(tmp_path), rank=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            init = torch.arange(3000, dtype=torch.float32)
            mapped = files.create("0.master", 3000, init=init)
            files.create("1.master", 10)
        assert torch.equal(mapped, init)
        assert files.direct is (not refuse and hasattr(os, "O_DIRECT"))
        said = [str(w.message) for w in caught if "direct I/O is not supported" in str(w.message)]
        assert len(said) == (1 if refuse else 0), said  # once, not once per file
        buf = nvme.aligned_empty(2048)
        assert buf.data_ptr() % nvme.ALIGN_BYTES == 0
        files.read("0.master", 1024, buf)  # elements 1024..3071 (the file is padded to 3072)
        assert torch.equal(buf[: 3000 - 1024], init[1024:])
        buf.fill_(-1.0)
        files.write("0.master", 1024, buf[:1024])
        assert torch.equal(mapped[1024:2048], torch.full((1024,), -1.0))  # the mapping sees it
        assert torch.equal(mapped[:1024], init[:1024])
        where = files.dir
        assert where.parent == tmp_path and where.name.startswith("zerorun-r3-")
        files.close()
        assert not where.exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_checks.sh)")
def test_copier_casts_host_to_host_through_the_device() -> None:
    """Stage 3 parameter offload's write-back (fp32 master tile -> bf16 host shard) runs on the
    copy stream through the GPU, asynchronously into pinned memory: after its event the host
    shard equals the CPU cast, and the CPU did no conversion."""
    from zerorun.runtime.offload.host import Copier, host_empty

    copier = Copier(torch.device("cuda"))
    n = (1 << 20) + 5
    src = host_empty(n, torch.float32, pin=True)
    src.copy_(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    dst = host_empty(n, torch.bfloat16, pin=True)
    dst.zero_()
    done = copier.to_device(dst, src, copier.ready())
    assert done is not None  # asynchronous: an event to wait for
    Copier.wait(done)
    assert torch.equal(dst, src.to(torch.bfloat16))
    same = host_empty(n, torch.float32, pin=True)
    assert copier.to_device(same, src, None) is None and torch.equal(same, src)  # same dtype: a host copy


def test_early_steps_finish_what_the_step_needs_then_what_the_forward_uses_first() -> None:
    """HostPlacement._priority: buffers whose write-back the step must finish (not among the
    stage's ``deferrable`` -- stage 3's persistent group --, or the destination not known yet)
    first; the deferred ones in the order the next forward uses them (stage 3: ascending flat
    buffer index; stages 1-2, buffers in gradient order: descending). Only an early step may
    defer (no clipping)."""
    from zerorun.runtime.offload import placement_for
    from zerorun.runtime.settings import settings_from_config

    def placement(stage: int, param: bool, clip: float = 0.0):  # noqa: ANN202
        zero: dict = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
        if param:
            zero["offload_param"] = {"device": "cpu"}
        cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
               "gradient_clipping": clip, "zero_optimization": zero}  # fmt: skip
        p = placement_for(settings_from_config(load_config(cfg).config, world_size=1), torch.device("cpu"))
        p.masters = [torch.zeros(1) for _ in range(5)]
        p._targets = {i: torch.zeros(1) for i in range(5)}
        return p

    s3 = placement(3, param=True)
    assert not any(s3._deferrable(i) for i in range(5))  # the stage has not said what it settles
    s3.deferrable = frozenset({1, 2, 3, 4})  # (Stage3: every group but the persistent one)
    assert [s3._deferrable(i) for i in range(5)] == [False, True, True, True, True]
    assert sorted(reversed(range(5)), key=s3._priority) == [0, 1, 2, 3, 4]
    # The stage's own order (Stage3.settle_order at one rank: the persistent group, read by
    # every module, first -- here buffer 4 --, then the groups in index order).
    s3.deferrable, s3.settle_order = frozenset(range(5)), (4, 0, 1, 2, 3)
    assert sorted(range(5), key=s3._priority) == [4, 0, 1, 2, 3]
    s3.deferrable, s3.settle_order = frozenset({1, 2, 3, 4}), ()
    del s3._targets[2]  # first step: destination not known yet -> finished by the step
    assert sorted(reversed(range(5)), key=s3._priority)[:2] == [2, 0]
    s2 = placement(2, param=False)
    assert len({s2._priority(i) for i in range(5)}) == 1  # nothing deferred: index order (gradient order)
    s2.deferrable = frozenset(range(5))  # (FlatStage: every flat buffer)
    assert sorted(range(5), key=s2._priority) == [4, 3, 2, 1, 0]  # the forward uses the last first
    clipped = placement(2, param=False, clip=1.0)
    clipped.deferrable = frozenset(range(5))
    assert not clipped.may_defer and not any(clipped._deferrable(i) for i in range(5))
    for p in (s3, s2, clipped):
        p.close()


def test_the_worker_steps_an_arrived_gradient_before_waiting_for_a_better_one() -> None:
    """pick_next: of the buffers whose gradient is on the host, the best priority (then the
    first queued); none arrived: the first queued (the GPU reduces in queue order), never the
    best-priority one whose gradient the GPU produces last."""
    from zerorun.runtime.offload.host_placement import pick_next

    now = (0, 0)
    queue = [(now, 0, 23), (now, 1, 22), (now, 2, 21)]  # stage 3: reduced last block first
    assert pick_next(queue, lambda i: False) == (now, 0, 23)
    assert pick_next(queue, lambda i: i != 23) == (now, 1, 22)  # 22's copy landed first: go
    assert pick_next(queue, lambda i: True) == (now, 0, 23)  # FIFO among the arrived
    deferred = [((1, 5), 0, 6), ((1, 3), 1, 4), ((1, 0), 2, 1), (now, 3, 9)]
    assert pick_next(deferred, lambda i: True) == (now, 3, 9)  # what the step waits for first
    assert pick_next(deferred, lambda i: i in (6, 4)) == ((1, 3), 1, 4)  # forward order among arrived
    assert pick_next(deferred, lambda i: False) == ((1, 5), 0, 6)
