"""`zerorun estimate`'s model at 1,024 and 8,192 ranks: the Contract 4 table, fast (pure)."""

from __future__ import annotations

import time

import pytest

from zerorun.config import load_config
from zerorun.estimate import GB, model_state_bytes

# bytes per element after the backward, bf16 + AdamW: (replicated part, partitioned part)
TABLE = {0: (18, 0), 1: (6, 12), 2: (2, 16), 3: (0, 16)}


def _config(stage: int, **extra: object):
    return load_config({"bf16": {"enabled": True}, "optimizer": {"type": "AdamW"},
                        "zero_optimization": {"stage": stage, **extra}})


@pytest.mark.parametrize("world", [1024, 8192])
def test_per_rank_model_states_follow_the_table_at_scale(world: int) -> None:
    configs = {stage: _config(stage) for stage in TABLE}
    t0 = time.monotonic()
    for psi in (1_343_426_560, 175_000_000_000, 1_000_000_000_003):
        for stage, (rep, part) in TABLE.items():
            est = model_state_bytes(psi, world, configs[stage])
            assert est.model_states("gpu") == pytest.approx(rep * psi + part * psi / world, rel=1e-12)
            assert est.between_steps("gpu") == pytest.approx(est.model_states("gpu") - est.terms["gpu"]["grads"])
            assert est.model_states("cpu") == 0
    assert time.monotonic() - t0 < 5.0
    # ZeRO-3 makes a 1T-parameter model's states fit 80 GB GPUs from 1,024 ranks on (16Ψ/N)
    big = model_state_bytes(1_000_000_000_000, world, configs[3])
    assert big.model_states("gpu") / GB == pytest.approx(16e12 / world / GB)
    assert big.model_states("gpu") < 80 * GB


def test_offload_at_8192_ranks_leaves_the_gpu_only_the_gradient_slice() -> None:
    psi, n = 175_000_000_000, 8192
    est = model_state_bytes(psi, n, _config(3, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"}))
    assert est.model_states("gpu") == pytest.approx(4 * psi / n)  # fp32 gradient slices, Contract 4
    assert est.between_steps("gpu") == pytest.approx(0)
    assert est.model_states("cpu") == pytest.approx(18 * psi / n)
