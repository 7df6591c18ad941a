"""One rank of test_stage3_build.py: how stage 3's initialize builds the fp32 master shards.

For each case (optimizer / parameter offload, a normally built or a ``zero.Init``-built S3Net)
``zerorun.runtime.stage3.build._fp32_shards`` is wrapped to record where each group's fp32
initial values are cut and how many cut shards of earlier groups are still alive when the next
group is cut (a weakref finalizer per shard); after initialize the master shards are compared
bit for bit with the fp32 values of the same model built normally from the same seed. Rank 0
writes {case: [result per rank]} to argv[1]."""

from __future__ import annotations

import gc
import json
import sys
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _s3_models as M  # noqa: E402

import zerorun  # noqa: E402
from zerorun.runtime.stage3 import build  # noqa: E402

THRESHOLD = 40  # as _s3_worker.py: LayerNorms and biases persistent, linears and the embedding partitioned
SEED = 31


class CutRecorder:
    """Wraps ``build._fp32_shards``: per call (one group) the device and the shards of earlier
    calls still alive."""

    def __init__(self) -> None:
        self.alive = 0
        self.calls: list[dict] = []
        self._orig = build._fp32_shards

    def _dead(self) -> None:
        self.alive -= 1

    def __call__(self, layouts, params, rank, device):  # noqa: ANN001, ANN204
        self.calls.append({"device": str(torch.device(device)), "alive_before": self.alive})
        out = self._orig(layouts, params, rank, device)
        for t in out:
            self.alive += 1
            weakref.finalize(t, self._dead)
        return out


def config(optimizer: str, param: str, nvme: Path, ratio: float | None = None) -> dict:
    zero: dict = {"stage": 3, "stage3_param_persistence_threshold": THRESHOLD}
    if optimizer != "none":
        zero["offload_optimizer"] = {"device": optimizer, "pin_memory": True}
        if optimizer == "nvme":
            zero["offload_optimizer"]["nvme_path"] = str(nvme)
        if ratio is not None:
            zero["offload_optimizer"]["ratio"] = ratio
    if param != "none":
        zero["offload_param"] = {"device": param, "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }


def expected_shard(layout, rank: int, ref: dict[str, torch.Tensor]) -> torch.Tensor:  # noqa: ANN001
    start, end = layout.shard_range(rank)
    out = torch.zeros(end - start, dtype=torch.float32)
    for slot in layout.slots:
        lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
        if lo < hi:
            out[lo - start : hi - start] = ref[slot.name].reshape(-1)[lo - slot.offset : hi - slot.offset]
    return out


def run_case(name: str, cfg: dict, how: str) -> dict:
    torch.manual_seed(SEED)
    ref_model = M.S3Net()
    ref = {n: p.detach().float().cpu().clone() for n, p in ref_model.named_parameters(remove_duplicate=False)}
    rec = CutRecorder()
    build._fp32_shards = rec
    try:
        torch.manual_seed(SEED)
        if how == "init":
            with zerorun.zero.Init(config=cfg, remote_device="cpu"):
                model = M.S3Net()
        else:
            model = M.S3Net()
        engine, *_ = zerorun.initialize(model=model, config=cfg)
    finally:
        build._fp32_shards = rec._orig
    gc.collect()
    state = engine.stage.state
    rank = engine.global_rank
    exact, not_rounded = True, False
    for layout, master in zip(state.layouts, state.masters, strict=True):
        want = expected_shard(layout, rank, ref)
        got = master.detach().float().cpu()
        exact = exact and torch.equal(got, want)
        not_rounded = not_rounded or not torch.equal(want, want.to(torch.bfloat16).float())
    # One training step still works from these masters (the placement's buffers are in place).
    ids = torch.randint(0, M.VOCAB, (2, M.SEQ), generator=torch.Generator().manual_seed(rank)).to(
        engine.device
    )
    loss = engine(ids, ids)
    engine.backward(loss)
    engine.step()
    out = {
        "optimizer_device": str(state.placement.optimizer_device),
        "training_device": str(engine.device),
        "groups": len(engine.stage.groups),
        "cuts": rec.calls,
        "alive_after": rec.alive,
        "masters_exact": exact,
        "masters_not_bf16": not_rounded,
        "master_devices": sorted({str(m.device) for m in state.masters}),
        "n_masters": len(state.masters),
        "persistent_masters": sum(len(g.layouts) for g in engine.stage.groups if g.persistent),
        "twinflow_device_masters": sum(getattr(state.placement, "on_device", [])),
        # per flat buffer of the partitioned groups: (Twin-Flow keeps its master on the device,
        # the at-rest shard's dtype, the at-rest shard is the master's storage)
        "rest": [
            (
                bool(state.placement.master_on_device(layout.index)) if hasattr(state.placement, "master_on_device") else None,
                str(g.at_rest[li].dtype),
                g.at_rest[li].untyped_storage().data_ptr() == state.masters[layout.index].untyped_storage().data_ptr(),
            )
            for g in engine.stage.groups
            if not g.persistent
            for li, layout in enumerate(g.layouts)
        ],
        "loss": float(loss),
    }
    engine.destroy()
    return out


def main() -> None:
    out_path = Path(sys.argv[1])
    nvme = out_path.parent / "nvme"
    nvme.mkdir(exist_ok=True)
    cases = {
        "cpu-cpu": (config("cpu", "cpu", nvme), "normal"),
        "cpu-cpu-init": (config("cpu", "cpu", nvme), "init"),
        "cpu-none": (config("cpu", "none", nvme), "normal"),
        "nvme-cpu": (config("nvme", "cpu", nvme), "normal"),
        "nvme-none-init": (config("nvme", "none", nvme), "init"),
        "ratio-cpu": (config("cpu", "cpu", nvme, ratio=0.5), "normal"),
        "ratio-none": (config("cpu", "none", nvme, ratio=0.5), "normal"),
        "none-none": (config("none", "none", nvme), "normal"),
    }
    mine = {name: run_case(name, cfg, how) for name, (cfg, how) in cases.items()}
    ranks = [mine]
    if torch.distributed.is_initialized():
        ranks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, mine)
        if torch.distributed.get_rank() != 0:
            return
    out_path.write_text(json.dumps({name: [r[name] for r in ranks] for name in mine}, indent=1))


if __name__ == "__main__":
    main()
