"""The delayed parameter update (zerorun.delayed_param_update) against a plainly written
one-step-delayed reference, step by step, in the configuration of the benchmark that showed the
GPU defect: the README's GPT, CPU optimizer offload with pinned memory, many flat buffers and
several pipeline tiles per buffer, the worker thread, an LR scheduler (WarmupLR), exact warm-up
steps before the delayed ones, and the benchmark's step loop (losses kept as device tensors: no
host sync between steps, so nothing but the pipeline's own events orders the copies).

Reference (docs/offload.md):  theta[t+1] = U(theta[t], grad L_t(theta[t-1])) once t >= warmup
(theta[t+1] = U(theta[t], grad L_t(theta[t])) before), the optimizer step of step t with the
learning rate the scheduler gave step t; fp32 masters, torch's fused CPU AdamW (the kernel the
offloaded step runs), a 16-bit compute copy, each rank's 16-bit gradients averaged in fp32,
clipped by the exact global norm, fp16 loss scales taken from the engine (skipped steps too).

argv: OUT_JSON [CASE,CASE,...]. Every rank runs every case; rank 0 computes the reference and
writes {case: result}. ZR_DPU_SIZE picks the model (default "tiny"; the GPU check uses a
bigger one), ZR_DPU_STEPS the steps, ZR_DPU_CASES (comma list) the cases. Run by test_offload_delayed.py through _spawn, and by
scripts/gpu_checks.sh on the GPU (world 1 on NCCL and 2 ranks sharing the GPU).
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

_EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(_EXAMPLES))

import gpt_model  # noqa: E402

import zerorun  # noqa: E402
from zerorun.runtime.scheduler import WarmupLR  # noqa: E402

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.01
CLIP = 0.5
SCHED_STEPS = 4  # WarmupLR: linear from 0 to LR over these steps
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DCase:
    stage: int
    dtype: str
    clip: float
    warmup: int = 2  # exact steps before the delayed ones

    @property
    def name(self) -> str:
        return f"z{self.stage}-{self.dtype}-clip{self.clip:g}-warm{self.warmup}"


CASES = [DCase(s, d, c) for s in (1, 2, 3) for d in ("bf16", "fp16") for c in (0.0, CLIP)]
CASES += [DCase(2, "bf16", 0.0, warmup=0)]


def sizes() -> tuple[gpt_model.GPTConfig, int, int, int]:
    """(model config, micro batch, reduce_bucket_size, sub_group_size): many flat buffers, each
    several pipeline tiles."""
    size = os.environ.get("ZR_DPU_SIZE", "tiny")
    if size == "tiny":
        cfg = gpt_model.get_config("tiny", seq_len=32)
        return cfg, 2, 12_000, 3_000
    cfg = gpt_model.get_config(size, seq_len=int(os.environ.get("ZR_DPU_SEQ", "512")))
    return cfg, int(os.environ.get("ZR_DPU_MICRO", "4")), 5_000_000, 1 << 20


def config(case: DCase, micro: int, bucket: int, sub_group: int) -> dict:
    zero = {
        "stage": case.stage,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "sub_group_size": sub_group,
        "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    }
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": case.clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": LR,
                "warmup_num_steps": SCHED_STEPS,
                "warmup_type": "linear",
            },
        },
        "zero_optimization": zero,
        "steps_per_print": 1000,
        "zerorun": {"delayed_param_update": True, "delayed_param_update_warmup": case.warmup},
    }
    if case.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    else:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 3, "hysteresis": 1}
    return cfg


def build(cfg: gpt_model.GPTConfig, device: torch.device) -> gpt_model.GPT:
    """The same initial weights on every device: drawn on the CPU (CUDA's generator gives other
    numbers for the same seed), then moved."""
    torch.manual_seed(11)
    with torch.device("cpu" if device.type == "cuda" else device):
        model = gpt_model.GPT(cfg)
    return model.to(device)


def reference(case: DCase, cfg, micro: int, world: int, steps: int, scales: list[float], device) -> dict:
    dtype = DTYPES[case.dtype]
    master = build(cfg, torch.device("cpu"))
    compute = copy.deepcopy(master).to(device, dtype)
    m_params, c_params = list(master.parameters()), list(compute.parameters())
    opt = torch.optim.AdamW(m_params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    sched = WarmupLR(opt, 0.0, LR, SCHED_STEPS, "linear")
    data = [gpt_model.SyntheticTokens(cfg, micro, device, seed=5, rank=r) for r in range(world)]
    losses, taken = [], 0
    for step in range(steps):
        scale = scales[step]
        total = [torch.zeros_like(p, dtype=torch.float32) for p in c_params]
        step_losses = []
        for rank in range(world):
            x, y = data[rank].batch(step)
            loss = compute(x, y)
            step_losses.append(float(loss.detach()))
            (loss * scale).backward()
            for t, p in zip(total, c_params, strict=True):
                t.add_(p.grad.float() / world)
                p.grad = None
        losses.append(step_losses)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in total])) / scale
        if not math.isfinite(float(norm)):
            continue  # fp16 overflow: the step is skipped (no update, no scheduler step)
        # The engine's arithmetic (engine._unscale_and_clip): one coefficient, unscale folded in.
        coef = torch.clamp(torch.tensor(case.clip) / (norm.cpu() + 1e-6), max=1.0) if case.clip > 0 else None
        if coef is not None and scale != 1.0:
            coef = coef / scale
        for p, t in zip(m_params, total, strict=True):
            g = t.cpu()
            if coef is not None:
                g.mul_(coef)
            elif scale != 1.0:
                g.mul_(1.0 / scale)
            p.grad = g
        before = [p.detach().clone() for p in m_params]
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        delayed = taken >= case.warmup
        taken += 1
        with torch.no_grad():  # the parameters the next forward sees
            for c, m in zip(c_params, before if delayed else m_params, strict=True):
                c.copy_(m)
    return {"losses": losses, "master": {n: p.detach().clone() for n, p in master.named_parameters()}}


def run_case(case: DCase, rank: int, world: int, steps: int) -> dict | None:
    cfg, micro, bucket, sub_group = sizes()
    device = torch.device(os.environ.get("ZERORUN_DEVICE", "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    model = build(cfg, device)
    engine, _, _, _ = zerorun.initialize(model=model, config=config(case, micro, bucket, sub_group))
    placement = engine.stage.state.placement
    data = gpt_model.SyntheticTokens(cfg, micro, engine.device, seed=5, rank=rank)
    batches = [data.batch(i) for i in range(steps)]
    scales, losses = [], []
    for x, y in batches:  # benchmarks/measure.py's loop: no host sync between steps
        scales.append(engine.get_loss_scale())
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    losses_f = torch.stack([v.float().reshape(()) for v in losses]).cpu().tolist()
    engine.stage.state.synchronize()  # the step in flight: masters current
    from _models import full_masters  # noqa: PLC0415 - tests/runtime, the script's folder (not a package import)

    masters = full_masters(engine)
    info = {
        "losses": losses_f,
        "scales": scales,
        "skipped": engine.skipped_steps,
        "delayed_steps": getattr(placement, "delayed_steps", 0),
        "overlapped": getattr(placement, "overlapped_buffers", 0),
        "n_buffers": len(engine.stage.layouts),
        "max_tiles": max((len(t) for t in getattr(placement, "tiles", [])), default=0),
        "placement": type(placement).__name__,
    }
    engine.destroy()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, info)
    if rank != 0:
        return None
    ref = reference(case, cfg, micro, world, steps, scales, device)
    names = [n for n, _ in build(cfg, torch.device("meta")).named_parameters()]
    # Per parameter tensor, relative to its largest value: the worst element, and how many
    # elements differ beyond 1e-3 (Adam moves an element whose gradient is ~0 by +-lr whatever
    # its size, so a last-bit difference that flips such a gradient's sign moves that element by
    # up to 2 lr; a wrong update moves nearly every element).
    worst, off, total = 0.0, 0, 0
    for n in names:
        a, b = masters[n].float(), ref["master"][n].float()
        rel = (a - b).abs() / max(1e-3, float(b.abs().max()))
        worst = max(worst, float(rel.max()))
        off += int((rel > 1e-3).sum())
        total += rel.numel()
    return {
        "ranks": gathered,
        "ref_losses": ref["losses"],
        "master_rel_err": worst,
        "master_frac_off": off / max(1, total),
        "n_params": sum(ref["master"][n].numel() for n in names),
    }


def main() -> None:
    out_path = Path(sys.argv[1])
    picked = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("ZR_DPU_CASES", "")
    only = set(picked.split(",")) if picked else None
    steps = int(os.environ.get("ZR_DPU_STEPS", "7"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results: dict = {}
    for case in CASES:
        if only and case.name not in only:
            continue
        t0 = time.monotonic()
        r = run_case(case, rank, world, steps)
        if r is not None:
            r["seconds"] = time.monotonic() - t0
            results[case.name] = r
            out_path.write_text(json.dumps(results))  # kept as cases finish (a deadline keeps what ran)
    if rank == 0:
        out_path.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
