"""One rank of the equivalence matrix: every case in one launch, reference computed on rank 0.

argv: OUT_JSON. Rank 0 writes {case name: result}. Run by test_equivalence.py via _spawn.
"""

from __future__ import annotations

import json
import math
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _cases  # noqa: E402
import _models  # noqa: E402

import zerorun  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def config_for(case: _cases.Case) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": _cases.MICRO_BATCH,
        "gradient_accumulation_steps": case.accum,
        "gradient_clipping": case.clip,
        "optimizer": {"type": "AdamW", "params": {"lr": _cases.LR, "weight_decay": _cases.WEIGHT_DECAY}},
        "zero_optimization": {"stage": case.stage, "reduce_bucket_size": _cases.BUCKET},
        "steps_per_print": 1000,
    }
    if case.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if case.comm:
        cfg["communication_data_type"] = case.comm
    if case.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 10, "hysteresis": 2, "loss_scale_window": 2}
    return cfg


def model_state_terms(engine, case: _cases.Case, world: int) -> tuple[dict, dict]:
    """Bytes of the four model-state terms this rank holds for the trainable parameters, and
    what zerorun.estimate (Contract 4) says for the same count and config."""
    from zerorun.estimate import model_state_bytes
    from zerorun.runtime.memory import MemoryLedger

    ledger = MemoryLedger()
    parts = engine.stage.memory_tensors()
    for term in ("params", "master", "grads", "optimizer_states"):
        ledger.add(term, parts[term])
    measured = next(iter(ledger.summary().values()))
    numel = sum(layout.numel for layout in engine.stage.layouts)
    est = model_state_bytes(numel, world, config_for(case))
    return measured, dict(est.terms["gpu"])


def read_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters (float, CPU) read through zerorun: GatheredParameters waits for the
    all-gather that stages 1-2 leave in flight after step(); a raw read between step() and the
    next forward may see the previous values (docs/runtime.md)."""
    with zerorun.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def run_case(case: _cases.Case, rank: int, world: int) -> dict | None:
    seed = 1234 + zlib.crc32(case.name.encode()) % 1000  # hash() differs between processes
    model = _models.make_model(seed)
    ref_model = _models.make_model(seed)
    engine, optimizer, _, _ = zerorun.initialize(model=model, config=config_for(case))
    reducer = engine.stage.reducer
    n_buckets = len(engine.stage.layouts)
    inject = {tuple(x) for x in case.inject}
    losses, norms, scales_before, scales_after, checksums = [], [], [], [], []
    for step in range(case.steps):
        scales_before.append(engine.get_loss_scale())
        before = torch.cat([v.reshape(-1) for v in read_params(model).values()]).sum().item()
        for micro in range(case.accum):
            ids, tgt = _models.batch(seed, step, micro, rank, _cases.MICRO_BATCH)
            loss = engine(ids.to(engine.device), tgt.to(engine.device))
            losses.append((step, micro, loss.item()))
            engine.backward(loss * math.inf if (step, rank) in inject else loss)
            if step == case.steps - 1 and micro == case.accum - 1:
                # Gradient memory exists from the step's first reduction to the optimizer step
                # (zero_grad frees it): measure the model states while all four terms are alive.
                engine.stage.grad_shards()
                measured, estimated = model_state_terms(engine, case, world)
            engine.step()
        norms.append(engine.get_global_grad_norm())
        scales_after.append(engine.get_loss_scale())
        after = torch.cat([v.reshape(-1) for v in read_params(model).values()]).sum().item()
        checksums.append((before, after))
    memory = engine.memory_summary()
    masters = _models.full_masters(engine)
    shard_numel = sum(layout.shard_numel for layout in engine.stage.layouts)
    result = {
        "rank": rank,
        "losses": losses,
        "norms": norms,
        "scales_before": scales_before,
        "scales_after": scales_after,
        "checksums": checksums,
        "skipped_steps": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "n_buckets": n_buckets,
        "launches": reducer.launches,
        "launched_during_backward": reducer.launched_during_backward,
        "memory": memory,
        "measured": measured,
        "estimated": estimated,
        "tied_kept": model.head.weight is model.emb.weight,
        "shard_numel": shard_numel,
        "trainable_numel": sum(s.numel for layout in engine.stage.layouts for s in layout.slots),
        "padded_numel": sum(layout.padded_numel for layout in engine.stage.layouts),
        "grads_at_rest": sum(m["grads"] for m in memory.values()),
        "step_parts": len(engine.stage._parts or []),
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    compute_params = read_params(model)
    device = engine.device
    engine.destroy()
    if rank != 0:
        return None

    ref = _models.reference_train(
        ref_model,
        dtype=DTYPES[case.dtype],
        world=world,
        steps=case.steps,
        accum=case.accum,
        micro_batch=_cases.MICRO_BATCH,
        case_seed=seed,
        clip=case.clip,
        lr=_cases.LR,
        weight_decay=_cases.WEIGHT_DECAY,
        scales=gathered[0]["scales_before"] if case.dtype == "fp16" else None,
        inject=inject,
        device=device,
    )
    ref_losses = [[ref.losses[s][m][r] for (s, m, _l) in gathered[r]["losses"]] for r in range(world)]
    got_losses = [[v for (_s, _m, v) in g["losses"]] for g in gathered]
    trainable = set(masters)
    return {
        "ranks": gathered,
        "got_losses": got_losses,
        "ref_losses": ref_losses,
        "ref_norms": ref.norms,
        "ref_skipped": ref.skipped,
        "master_err": {
            n: [float((masters[n] - ref.master[n]).abs().max()), float(ref.master[n].abs().max())]
            for n in trainable
        },
        "master_rel_l2": float(
            torch.linalg.vector_norm(torch.cat([(masters[n] - ref.master[n]).reshape(-1) for n in trainable]))
            / torch.linalg.vector_norm(torch.cat([ref.master[n].reshape(-1) for n in trainable]))
        ),
        "compute_err": {
            n: [
                float((compute_params[n] - ref.compute[n].float()).abs().max()),
                float(ref.compute[n].float().abs().max()),
            ]
            for n in ref.compute
        },
        "frozen_unchanged": bool(
            torch.equal(
                compute_params["frozen.weight"],
                _models.make_model(seed).frozen.weight.to(DTYPES[case.dtype]).float(),
            )
        ),
    }


GOLDEN_CONFIGS = {
    "gpt-tiny-z2-fp32-w2": {"zero_optimization": {"stage": 2, "reduce_bucket_size": 20000}},
    "gpt-tiny-z1-bf16-w2": {
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 20000},
        "bf16": {"enabled": True},
    },
}


def golden_run(name: str, rank: int) -> list[float]:
    """examples/gpt_model.py's tiny GPT, a few steps: the losses guard against silent drift."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from gpt_model import GPT, SyntheticTokens, get_config

    cfg_model = get_config("tiny", seq_len=32)
    torch.manual_seed(7)
    model = GPT(cfg_model)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
        "steps_per_print": 1000,
        **GOLDEN_CONFIGS[name],
    }
    engine, *_ = zerorun.initialize(model=model, config=cfg)
    data = SyntheticTokens(cfg_model, 2, engine.device, seed=7, rank=rank)
    losses = []
    for micro in range(12):
        loss = engine(*data.batch(micro))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, losses)
    return [round(sum(x) / len(x), 6) for x in zip(*gathered, strict=True)]


def main() -> None:
    out_path = Path(sys.argv[1])
    only = set(sys.argv[2].split(",")) if len(sys.argv) > 2 and sys.argv[2] else None
    # CUDA runs (scripts/gpu_checks.sh) also need CUBLAS_WORKSPACE_CONFIG=:4096:8.
    torch.use_deterministic_algorithms(True, warn_only=torch.cuda.is_available())
    # The process group is created by the first initialize and reused by every later one.
    rank = int(__import__("os").environ["RANK"])
    world = int(__import__("os").environ["WORLD_SIZE"])
    results = {}
    t0 = time.monotonic()
    for case in _cases.matrix(world):
        if only and case.name not in only:
            continue
        t = time.monotonic()
        r = run_case(case, rank, world)
        if r is not None:
            r["seconds"] = time.monotonic() - t
            results[case.name] = r
    if world == 2 and not only:
        results["_golden"] = {name: golden_run(name, rank) for name in GOLDEN_CONFIGS}
    if rank == 0:
        results["_total_seconds"] = time.monotonic() - t0
        out_path.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
