"""Loss scaler (DeepSpeed's rule), learning-rate schedules (DeepSpeed's formulas), batch triad."""

from __future__ import annotations

import math

import pytest
import torch

from zerorun.errors import RuntimeConfigError
from zerorun.runtime.precision import LossScaler
from zerorun.runtime.scheduler import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler
from zerorun.runtime.settings import resolve_batch


def test_dynamic_scale_follows_deepspeed() -> None:
    s = LossScaler(dynamic=True, init_scale=2.0**4, window=3, hysteresis=2, min_scale=2.0)
    seq = []
    for overflow in [False, True, True, False, False, False, True, True, True, True]:
        s.update(overflow)
        seq.append(s.scale)
    # iter0 clean (0-(-1)=1, no raise); iter1 overflow eats hysteresis; iter2 halves; iter3,4 clean;
    # iter5: 5-2=3 -> doubles and refills hysteresis; iter6 eats it; 7 halves; 8 halves; 9 at min.
    assert seq == [16, 16, 8, 8, 8, 16, 16, 8, 4, 2]
    with pytest.raises(RuntimeConfigError, match="minimum"):
        s.update(True)


def test_scale_grows_after_window_without_overflow() -> None:
    s = LossScaler(dynamic=True, init_scale=1.0, window=2, hysteresis=1)
    for _ in range(6):
        s.update(False)
    # iterations 1, 3, 5 satisfy (iter - (-1)) % 2 == 0
    assert s.scale == 8.0


def test_static_scale_never_changes() -> None:
    s = LossScaler(dynamic=False, init_scale=128.0)
    for o in (True, True, False):
        s.update(o)
    assert s.scale == 128.0


def _opt(lr: float = 0.1, groups: int = 1) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)]} for _ in range(groups)], lr=lr)


def _lrs(sched, opt, n):  # noqa: ANN001, ANN202
    out = [opt.param_groups[0]["lr"]]
    for _ in range(n):
        sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


def test_warmup_lr_log_and_linear() -> None:
    opt = _opt()
    lrs = _lrs(WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10), opt, 12)
    assert lrs[0] == 0.0 and lrs[1] == 0.0  # constructed at min; iteration 0 is still min (log 1 = 0)
    assert lrs[5] == pytest.approx(math.log(5) / math.log(10))
    assert lrs[11] == lrs[12] == 1.0
    opt = _opt()
    lrs = _lrs(
        WarmupLR(opt, warmup_min_lr=0.1, warmup_max_lr=0.5, warmup_num_steps=4, warmup_type="linear"), opt, 6
    )
    assert lrs == pytest.approx([0.1, 0.1, 0.2, 0.3, 0.4, 0.5, 0.5])


def test_warmup_decay_lr_reaches_zero() -> None:
    opt = _opt()
    lrs = _lrs(
        WarmupDecayLR(opt, total_num_steps=10, warmup_max_lr=1.0, warmup_num_steps=2, warmup_type="linear"),
        opt,
        11,
    )
    assert lrs[1:4] == pytest.approx([0.0, 0.5, 1.0])
    assert lrs[7] == pytest.approx((10 - 6) / 8)
    assert lrs[11] == 0.0


def test_warmup_cosine_lr() -> None:
    opt = _opt(lr=2.0)
    s = WarmupCosineLR(opt, total_num_steps=12, warmup_num_steps=2, warmup_type="linear", cos_min_ratio=0.1)
    lrs = _lrs(s, opt, 12)
    assert lrs[0] == 0.0 and lrs[1] == 0.0 and lrs[2] == pytest.approx(1.0)
    # iteration 2: first cosine step: real_step 1 of 10
    assert lrs[3] == pytest.approx(2.0 * (0.1 + 0.9 * (1 + math.cos(math.pi * 1 / 10)) / 2))
    assert lrs[12] == pytest.approx(2.0 * 0.1)


def test_build_scheduler_errors_and_auto() -> None:
    opt = _opt(lr=0.3)
    s = build_scheduler("WarmupLR", {"warmup_max_lr": "auto", "warmup_num_steps": 5}, opt)
    assert s.max_lrs == [0.3]
    with pytest.raises(RuntimeConfigError, match="warmup_num_steps"):
        build_scheduler("WarmupLR", {"warmup_num_steps": "auto"}, _opt())
    with pytest.raises(RuntimeConfigError, match="OneCycle"):
        build_scheduler("OneCycle", {}, _opt())
    with pytest.raises(RuntimeConfigError, match="warmup_typo"):
        build_scheduler("WarmupLR", {"warmup_typo": 1}, _opt())


def test_batch_triad() -> None:
    assert resolve_batch(32, 4, None, 2) == (32, 4, 4)
    assert resolve_batch(32, None, 2, 2) == (32, 8, 2)
    assert resolve_batch(None, 4, 2, 2) == (16, 4, 2)
    assert resolve_batch(None, 4, None, 3) == (12, 4, 1)
    with pytest.raises(RuntimeConfigError, match="must equal"):
        resolve_batch(30, 4, 2, 2)
    # the rule and its arithmetic are zerorun.config's (config/batch.py), the type the runtime's
    with pytest.raises(RuntimeConfigError, match="not divisible by train_micro_batch_size_per_gpu 4 × world size 2"):
        resolve_batch(30, 4, None, 2)
    assert resolve_batch(32, None, None, 4) == (32, 8, 1)  # only the global batch: accumulation 1
    with pytest.raises(RuntimeConfigError, match="gradient_accumulation_steps 2 × world size 4"):
        resolve_batch(30, None, 2, 4)
    with pytest.raises(RuntimeConfigError, match="train_micro_batch_size_per_gpu"):
        resolve_batch(None, None, 2, 2)
