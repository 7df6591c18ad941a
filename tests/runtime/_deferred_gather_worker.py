"""The parameter all-gather that stages 1-2 leave in flight after step() (FlatStage.wait_params),
checked on every path that reads parameters through zerorun (argv: OUT_JSON TMP_DIR).

Each check trains one step, asserts the gather is still pending when step() returns (the stage's
Pending list, not timing), reads the parameters through one path and compares them with the
updated fp32 masters (all-gathered separately) cast to the compute dtype -- and with the values
before the step, which must differ. Rank 0 writes {case/check: "ok" | "FAIL: ..."}.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import _models  # tests/runtime is the workers' script folder
import torch
import torch.distributed as dist

import zerorun
from zerorun.runtime.flat_stage import FlatStage

CASES = {  # name -> (stage, dtype, reduce_bucket_size): small buckets = pipelined step, large = one part
    "z1-bf16-pipelined": (1, "bf16", 64),
    "z2-bf16-pipelined": (2, "bf16", 64),
    "z2-fp32-pipelined": (2, "fp32", 64),
    "z2-bf16-one-part": (2, "bf16", 1_000_000),
    # CPU optimizer offload, no clipping: from the second step on the write-backs themselves are
    # left in flight too (docs/offload.md), settled by the same paths (+ the gathers issued then).
    "z2-bf16-offload": (2, "bf16", 64),
}
OFFLOAD = {"z2-bf16-offload"}
MICRO_BATCH = 2


def config(stage: int, dtype: str, bucket: int, offload: bool = False) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket},
        "steps_per_print": 1000,
    }
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


class Run:
    def __init__(self, name: str, tmp: Path) -> None:
        stage, dtype, bucket = CASES[name]
        self.tmp = tmp / name
        self.tmp.mkdir(parents=True, exist_ok=True)
        cfg = config(stage, dtype, bucket, offload=name in OFFLOAD)
        self.engine, *_ = zerorun.initialize(model=_models.make_model(0), config=cfg)
        self.offload = name in OFFLOAD
        self.dtype = self.engine.module.up.weight.dtype
        self.steps = 0
        assert isinstance(self.engine.stage, FlatStage)
        self.stage: FlatStage = self.engine.stage
        if self.offload:  # the first step learns the destinations: defers nothing yet
            self.step()
            self.stage.wait_params()

    def trained(self) -> tuple[str, ...]:
        return tuple(name for layout in self.stage.layouts for name in (s.name for s in layout.slots))

    def raw(self) -> dict[str, torch.Tensor]:
        """Parameters read raw (p.data): no wait of any kind."""
        named = dict(self.engine.module.named_parameters())
        return {n: named[n].data.detach().clone() for n in self.trained()}

    def step(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """One training step; (values before it, the updated masters in the compute dtype).
        Asserts that step() returned with the all-gather still owed a wait."""
        e = self.engine
        before = self.raw() if not self.stage.params_pending else None
        ids, targets = _models.batch(7, self.steps, 0, dist.get_rank(), MICRO_BATCH)
        e.backward(e(ids, targets))
        deferred = self.stage.deferred_gathers
        e.step()
        self.steps += 1
        if self.offload and self.steps >= 2:
            # Deferred only at one rank: at world > 1 settling would issue all-gathers that a
            # reader on one rank alone could not complete (check_state_dict_on_rank0_only).
            left = e.stage.state.placement.in_flight()
            if dist.get_world_size() == 1:
                assert left, "no write-back was left in flight"
            else:
                assert not left, f"write-backs left in flight at world > 1: {sorted(left)}"
        assert self.stage.params_pending, "step() returned with no parameter all-gather pending"
        assert self.stage.deferred_gathers == deferred + 1
        assert before is not None
        expected = {n: v.to(self.dtype) for n, v in _models.full_masters(e).items()}
        assert self.stage.params_pending, "gathering the masters waited for the parameters"
        return before, expected

    def check(self, got: dict[str, torch.Tensor], before: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
        assert not self.stage.params_pending, "the path did not wait for the parameter all-gather"
        changed = 0
        for n in self.trained():
            g = got[n].to(expected[n].device).reshape(expected[n].shape)
            assert g.dtype == expected[n].dtype, (n, g.dtype, expected[n].dtype)
            assert torch.equal(g, expected[n]), f"{n}: not the updated values"
            changed += not torch.equal(g, before[n])
        assert changed >= len(expected) // 2, f"only {changed} of {len(expected)} parameters changed"


def check_forward(r: Run) -> None:
    before, expected = r.step()
    ids, targets = _models.batch(9, 0, 0, dist.get_rank(), MICRO_BATCH)
    r.engine(ids, targets)  # the forward pre-hook waits; the values are read raw afterwards
    r.check(r.raw(), before, expected)


def check_eval_forward_of_the_module(r: Run) -> None:
    before, expected = r.step()
    ids, targets = _models.batch(9, 0, 0, dist.get_rank(), MICRO_BATCH)
    r.engine.eval()
    with torch.no_grad():
        r.engine.module(ids, targets)  # called directly, not through the engine
    r.engine.train()
    r.check(r.raw(), before, expected)


def check_state_dict(r: Run) -> None:
    before, expected = r.step()
    sd = r.engine.module.state_dict()
    r.check({n: sd[n] for n in r.trained()}, before, expected)


def check_state_dict_on_rank0_only(r: Run) -> None:
    """A reader on one rank alone between step() and the next forward (a script saving the
    weights from rank 0) must not wait for a collective the other ranks never issue."""
    before, expected = r.step()
    if dist.get_rank() == 0:
        sd = r.engine.module.state_dict()
        r.check({n: sd[n] for n in r.trained()}, before, expected)
    dist.barrier()  # the other ranks read nothing until rank 0 is done
    r.stage.wait_params()


def check_gathered_parameters(r: Run) -> None:
    before, expected = r.step()
    named = dict(r.engine.module.named_parameters())
    with zerorun.zero.GatheredParameters([named[n] for n in r.trained()]):
        got = r.raw()
    r.check(got, before, expected)


def check_save_16bit_model(r: Run) -> None:
    before, expected = r.step()
    out = r.tmp / "model16"
    assert r.engine.save_16bit_model(str(out))
    got = r.raw()
    r.check(got, before, expected)
    dist.barrier()
    saved = torch.load(out / "pytorch_model.bin", map_location="cpu", weights_only=True)
    r.check({n: saved[n] for n in r.trained()}, before, expected)


def check_save_checkpoint(r: Run) -> None:
    before, expected = r.step()
    r.engine.save_checkpoint(str(r.tmp / "ckpt"), tag="a")
    r.check(r.raw(), before, expected)


def check_load_checkpoint(r: Run) -> None:
    # Saved in check_save_checkpoint; a step after it, then the load must replace its values.
    r.step()
    r.engine.load_checkpoint(str(r.tmp / "ckpt"), tag="a")
    assert not r.stage.params_pending
    loaded = {n: v.to(r.dtype) for n, v in _models.full_masters(r.engine).items()}
    got = r.raw()
    for n in r.trained():
        assert torch.equal(got[n], loaded[n]), f"{n}: not the loaded values"


def check_destroy(r: Run) -> None:
    before, expected = r.step()
    r.engine.destroy()
    r.check(r.raw(), before, expected)


CHECKS: list[Callable[[Run], None]] = [
    check_forward,
    check_eval_forward_of_the_module,
    check_state_dict,
    check_state_dict_on_rank0_only,
    check_gathered_parameters,
    check_save_16bit_model,
    check_save_checkpoint,
    check_load_checkpoint,
    check_destroy,  # last: the engine is gone afterwards
]


def main() -> None:
    out, tmp = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    results: dict[str, str] = {}
    for name in CASES:
        run = Run(name, tmp)
        for check in CHECKS:
            key = f"{name}/{check.__name__.removeprefix('check_')}"
            try:
                check(run)
                results[key] = "ok"
            except Exception:  # noqa: BLE001
                results[key] = "FAIL: " + traceback.format_exc()[-3000:]
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
