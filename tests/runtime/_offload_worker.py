"""One rank of the offload tests: every case of _offload_cases in one launch; rank 0 computes the
plain single-process PyTorch reference and writes {case name: result}.

argv: OUT_JSON NVME_DIR [CASE,CASE,...]. Run by test_offload.py via _spawn.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _models  # noqa: E402
import _offload_cases as oc  # noqa: E402
import _reference as _ref  # noqa: E402

import zerorun  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class WideNet(nn.Module):
    """Big enough that a rank's shard spans several 1024-element NVMe tiles."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(_models.VOCAB, 48)
        self.up = nn.Linear(48, 96)
        self.down = nn.Linear(96, 48)
        self.head = nn.Linear(48, _models.VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.down(F.gelu(self.up(self.emb(ids))))
        return F.cross_entropy(self.head(h).float().view(-1, _models.VOCAB), targets.view(-1))


def make_model(case: oc.OCase, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return WideNet() if case.model == "wide" else _models.TinyNet()


# The reference uses torch's fused CPU Adam(W): the kernel the offloaded step runs (the default
# CPU loop rounds differently in the last fp32 bit, which a bf16 rounding flip can amplify).
OPTIMIZERS = {
    "adamw": (
        {"type": "AdamW", "params": {"lr": oc.LR, "weight_decay": oc.WEIGHT_DECAY}},
        lambda ps: torch.optim.AdamW(ps, lr=oc.LR, weight_decay=oc.WEIGHT_DECAY, fused=True),
    ),
    "adam_l2": (
        {"type": "Adam", "params": {"lr": oc.LR, "weight_decay": oc.WEIGHT_DECAY, "adam_w_mode": False}},
        lambda ps: torch.optim.Adam(ps, lr=oc.LR, weight_decay=oc.WEIGHT_DECAY, fused=True),
    ),
    "adam_amsgrad": (
        {"type": "AdamW", "params": {"lr": oc.LR, "weight_decay": oc.WEIGHT_DECAY, "amsgrad": True}},
        lambda ps: torch.optim.AdamW(ps, lr=oc.LR, weight_decay=oc.WEIGHT_DECAY, amsgrad=True, fused=True),
    ),
    "sgd": (
        {"type": "SGD", "params": {"lr": oc.LR, "momentum": 0.9, "weight_decay": oc.WEIGHT_DECAY}},
        lambda ps: torch.optim.SGD(ps, lr=oc.LR, momentum=0.9, weight_decay=oc.WEIGHT_DECAY),
    ),
}


def config_for(case: oc.OCase, nvme_dir: str) -> dict:
    zero: dict = {
        "stage": case.stage,
        "reduce_bucket_size": oc.BUCKET[case.model],
        "sub_group_size": oc.SUB_GROUP[case.model],
    }
    if case.device != "none":
        zero["offload_optimizer"] = {
            "device": case.device,
            "pin_memory": True,
            "nvme_path": nvme_dir,
            "buffer_count": 3,
        }
        if case.ratio != 1.0:
            zero["offload_optimizer"]["ratio"] = case.ratio
    if case.param != "none":
        zero["offload_param"] = {"device": case.param, "pin_memory": True, "nvme_path": nvme_dir}
    cfg: dict = {
        "train_micro_batch_size_per_gpu": oc.MICRO_BATCH,
        "gradient_accumulation_steps": case.accum,
        "gradient_clipping": case.clip,
        "optimizer": OPTIMIZERS[case.optim][0],
        "zero_optimization": zero,
        "steps_per_print": 1000,
        "zerorun": {"delayed_param_update": case.delayed, "delayed_param_update_warmup": case.warmup},
    }
    if case.budget_gb:
        cfg["zerorun"]["offload_gpu_budget_gb"] = case.budget_gb
    if case.stage == 3:
        zero["stage3_param_persistence_threshold"] = case.persistence
        cfg["zerorun"]["stage3_group_min_numel"] = 50  # TinyNet: 5+ partitioned groups
    if case.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if case.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 10, "hysteresis": 1, "loss_scale_window": 2}
    return cfg


def reference(
    model: nn.Module, case: oc.OCase, world: int, seed: int, scales: list[float] | None, device: torch.device
) -> _ref.RefResult:
    """The shared reference trainer (_reference.py) with this case's optimizer, the delayed
    update when the case has one, and the optimizer where the runtime's runs: with optimizer
    offload on the CPU (fused CPU Adam), else on the device. (On CUDA the fused GPU and CPU AdamW
    kernels differ in the last fp32 bit; in bf16 that can flip a compute weight, which later
    steps carry -- seen on an H200 at stage 3: 2.6e-4 master error against a 2e-4 bound, a grad
    norm 1.3e-5 off.)"""
    return _ref.reference_train(
        model,
        dtype=DTYPES[case.dtype],
        world=world,
        steps=case.steps,
        accum=case.accum,
        batch=lambda step, micro, rank: _models.batch(seed, step, micro, rank, oc.MICRO_BATCH),
        clip=case.clip,
        make_optimizer=OPTIMIZERS[case.optim][1],
        device=device,
        opt_device=torch.device("cpu") if case.device != "none" else device,
        scales=scales,
        inject={tuple(x) for x in case.inject},
        delayed=case.delayed,
        warmup=case.warmup,
    )


def compute_params(model: nn.Module, stage: int) -> dict[str, torch.Tensor]:
    # GatheredParameters at every stage: stage 3 gathers; at stages 1-2 it waits for the
    # all-gather that step() leaves in flight (raw reads may see the previous values).
    with zerorun.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def run_case(case: oc.OCase, rank: int, world: int, nvme_dir: str) -> dict | None:
    seed = 4321 + zlib.crc32(case.name.encode()) % 1000
    model = make_model(case, seed)
    ref_model = make_model(case, seed)
    engine, _, _, _ = zerorun.initialize(model=model, config=config_for(case, nvme_dir))
    placement = engine.stage.state.placement
    inject = {tuple(x) for x in case.inject}
    losses, norms, scales_before, in_flight, queued, pending = [], [], [], [], [], []
    ready: list[int] = []  # flat buffers in the order the stage said their gradients were final
    if hasattr(placement, "grad_ready"):
        hook = placement.grad_ready

        def record(index: int, grad_shard: torch.Tensor, optimizer: object) -> None:
            ready.append(index)
            if index < case.unhooked:
                return  # as if the stage could not tell: grad_for_step copies it, step() queues it
            hook(index, grad_shard, optimizer)

        placement.grad_ready = record
    for step in range(case.steps):
        ready.clear()
        scales_before.append(engine.get_loss_scale())
        for micro in range(case.accum):
            ids, tgt = _models.batch(seed, step, micro, rank, oc.MICRO_BATCH)
            loss = engine(ids.to(engine.device), tgt.to(engine.device))
            losses.append(loss.item())
            engine.backward(loss * math.inf if (step, rank) in inject else loss)
            if micro == case.accum - 1:  # CPU steps already queued when backward returns
                queued.append(len(getattr(placement, "_early_work", [])))
            engine.step()
        runner = getattr(placement, "runner", None)
        in_flight.append(bool(runner is not None and runner.busy))  # a delayed step still running
        pending.append(len(getattr(placement, "_deferred", {})))  # write-backs left to the fetches
        norms.append(engine.get_global_grad_norm())
    memory = engine.memory_summary()
    masters = _models.full_masters(engine)
    files_dir = getattr(getattr(placement, "files", None), "dir", None)
    store = getattr(placement, "param_store", None)
    info = {
        "rank": rank,
        "losses": losses,
        "norms": norms,
        "in_flight": in_flight,
        "placement": type(placement).__name__,
        "max_tiles": max((len(t) for t in getattr(placement, "tiles", [])), default=0),
        # bf16 gradients on the wire (options.narrow_grads + cpu_kernel): the dtype the copies fill
        "wire_dtypes": sorted({str(w.dtype) for w in getattr(placement, "wire", []) if w.numel()}),
        "delayed_steps": getattr(placement, "delayed_steps", 0),
        "early_steps": getattr(placement, "early_steps", 0),
        "queued_in_backward": queued,
        "profile": getattr(placement, "last_profile", {}),
        "n_buffers": len(engine.stage.layouts),
        "steps_taken": getattr(placement, "steps", 0),
        "skipped_steps": engine.skipped_steps,
        "memory": memory,
        "shard_numel": sum(layout.shard_numel for layout in engine.stage.layouts),
        "store_fetches": getattr(store, "fetches", None),
        "files": sorted(os.listdir(files_dir)) if files_dir else [],
        "direct_io": getattr(getattr(placement, "files", None), "direct", None),
        # Twin-Flow: which masters stayed on the device, the host's share of the elements
        "on_device": list(getattr(placement, "on_device", [])),
        "host_share": getattr(placement, "host_share", 1.0),
        "device_numel": sum(
            m.numel() for m, d in zip(engine.stage.state.masters, getattr(placement, "on_device", []), strict=False) if d
        ),
        "device_budget_numel": getattr(getattr(placement, "opts", None), "device_budget_numel", 0),
        "ready_order": list(ready),  # the last step's
        "deferred_write_backs": pending,
    }
    compute = compute_params(model, case.stage)
    engine.destroy()
    device = engine.device
    info["files_removed"] = files_dir is None or not os.path.exists(files_dir)
    gathered = [None] * world
    dist.all_gather_object(gathered, info)
    if rank != 0:
        return None
    ref = reference(ref_model, case, world, seed, scales_before if case.dtype == "fp16" else None, device)
    ref_losses = [
        [ref.losses[s][m][r] for s in range(case.steps) for m in range(case.accum)] for r in range(world)
    ]

    def err(a: torch.Tensor, b: torch.Tensor) -> list[float]:
        return [float((a - b).abs().max()), float(b.abs().max())]

    return {
        "ranks": gathered,
        "ref_losses": ref_losses,
        "ref_norms": ref.norms,
        "master_err": {n: err(masters[n], ref.master[n]) for n in masters},
        "compute_err": {n: err(compute[n], ref.compute[n].float()) for n in ref.compute},
    }


def _train(engine, seed: int, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids, tgt = _models.batch(seed, step, 0, rank, oc.MICRO_BATCH)
        loss = engine(ids.to(engine.device), tgt.to(engine.device))
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    return losses


def run_resume(case: oc.OCase, rank: int, world: int, nvme_dir: str, ckpt_dir: str) -> dict | None:
    """Save after 2 steps, keep training 2 more; a fresh engine that loads the checkpoint must
    train those 2 steps identically (masters, optimizer states -- NVMe files included -- restored
    through the placement). With the delayed update the save must hold the newest masters
    (synchronize joined the step in flight): an exact-mode engine loading it has the same masters."""
    seed = 99
    cfg = config_for(case, nvme_dir)
    engine, _, _, _ = zerorun.initialize(model=make_model(case, seed), config=cfg)
    _train(engine, seed, rank, range(2))
    engine.save_checkpoint(ckpt_dir, tag=case.name)
    saved = _models.full_masters(engine)
    after = _train(engine, seed, rank, range(2, 4))
    engine.destroy()
    exact_cfg = dict(cfg, zerorun={"delayed_param_update": False})
    resumed_engine, _, _, _ = zerorun.initialize(model=make_model(case, seed + 1), config=exact_cfg)
    resumed_engine.load_checkpoint(ckpt_dir, tag=case.name)
    loaded = _models.full_masters(resumed_engine)
    resumed = _train(resumed_engine, seed, rank, range(2, 4))
    resumed_engine.destroy()
    out = {
        "after": after,
        "resumed": resumed,
        "loaded_err": max(float((loaded[n] - saved[n]).abs().max()) for n in saved),
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    return {"ranks": gathered} if rank == 0 else None


def main() -> None:
    out_path, nvme_dir = Path(sys.argv[1]), sys.argv[2]
    only = set(sys.argv[3].split(",")) if len(sys.argv) > 3 and sys.argv[3] else None
    torch.use_deterministic_algorithms(True, warn_only=torch.cuda.is_available())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results: dict = {}
    t0 = time.monotonic()
    for case in oc.matrix(world):
        if only and case.name not in only:
            continue
        t = time.monotonic()
        r = run_case(case, rank, world, nvme_dir)
        if r is not None:
            r["seconds"] = time.monotonic() - t
            results[case.name] = r
    ckpt_dir = str(Path(nvme_dir).parent / "ckpt")
    for case in oc.resume_cases(world):
        if only and "resume-" + case.name not in only:
            continue
        r = run_resume(case, rank, world, nvme_dir, ckpt_dir)
        if r is not None:
            results["resume-" + case.name] = r
    if rank == 0:
        results["_total_seconds"] = time.monotonic() - t0
        out_path.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
