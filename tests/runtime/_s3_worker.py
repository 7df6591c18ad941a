"""One rank of the stage-3 tests: every case in one launch; rank 0 computes references and
writes {case: result} to argv[1]. Run by test_stage3.py through _spawn.spawn_ranks."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import zlib
from itertools import product
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _s3_models as M  # noqa: E402

import zerorun  # noqa: E402
from zerorun.errors import RuntimeConfigError  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MICRO, LR, WD, CLIP = 2, 2e-2, 0.01, 0.05
THRESHOLD = 40  # elements: LayerNorms and biases stay persistent, linears and the embedding partition


def config(dtype: str, accum: int, clip: float, **zero: object) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": THRESHOLD,
            "stage3_max_reuse_distance": 0,
            # ZR_S3_ZERO (JSON) overrides zero_optimization keys for a whole launch
            **json.loads(os.environ.get("ZR_S3_ZERO", "{}")),
            **zero,
        },
        "steps_per_print": 1000,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def gather_masters(engine) -> dict[str, torch.Tensor]:
    st = engine.stage.state
    out = {}
    for layout, master in zip(st.layouts, st.masters, strict=True):
        full = torch.empty(layout.padded_numel, dtype=torch.float32)
        if layout.num_shards > 1:
            dist.all_gather_into_tensor(
                full, master.detach().float().cpu().contiguous()
            )  # gloo: host tensors
        else:
            full.copy_(master.detach().float())
        for slot in layout.slots:
            out[slot.name] = full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
    return out


def train(engine, model, *, seed: int, rank: int, steps: int, accum: int) -> dict:
    losses, evals, norms = [], [], []
    stage = engine.stage
    for step in range(steps):
        model.flip = M.flip_for(step)
        for micro in range(accum):
            ids, tgt = M.batch(seed, step, micro, rank, MICRO)
            loss = engine(ids.to(engine.device), tgt.to(engine.device))
            losses.append(loss.item())
            engine.backward(loss)
            grads_after_backward = sum(d.get("grads", 0) for d in engine.memory_summary().values())
            engine.step()
        norms.append(engine.get_global_grad_norm())
        # eval-mode forward between training steps (generation-loop style)
        engine.eval()
        with torch.no_grad():
            ids, tgt = M.batch(seed, step, 99, 0, MICRO)
            evals.append(engine(ids.to(engine.device), tgt.to(engine.device)).item())
        engine.train()
        if hasattr(stage, "gathered_bytes"):
            assert stage.gathered_bytes() == 0, "groups left gathered after an eval forward"
    return {"losses": losses, "evals": evals, "norms": norms, "grads_after_backward": grads_after_backward}


def structure(engine) -> dict:
    st = engine.stage
    part = [g for g in st.groups if not g.persistent]
    return {
        "n_partitioned": len(part),
        "group_names": [g.name for g in st.groups],
        "prefetches": st.schedule.prefetches,
        "prefetch_hits": st.schedule.prefetch_hits,
        "launches": st.hooks.launches,
        "launched_during_backward": st.hooks.launched_during_backward,
        "peak_live_numel": st.schedule.peak_live_numel,
        "max_group_numel": max(g.numel for g in part),
        "root_numel": sum(g.numel for g in part if g.module is engine.module),
        "peak_staging_bytes": st.hooks.peak_staging_bytes,
        "max_group_staging_bytes": max(g.staging_bytes() * len(g.layouts) for g in st.groups),
        "at_rest_bytes": sum(r.numel() * r.element_size() for g in part for r in g.at_rest),
        "at_rest_numel": sum(r.numel() for g in part for r in g.at_rest),
        "partitioned_numel": sum(g.numel for g in part),
        "rest_is_master": all(
            r.data_ptr() == st.state.masters[layout.index].data_ptr()
            for g in part
            for layout, r in zip(g.layouts, g.at_rest, strict=True)
        ),
        "master_bytes_total": sum(m.numel() * m.element_size() for m in st.state.masters),
        "persistent_bytes": sum(
            f.numel() * f.element_size() for g in st.groups if g.persistent for f in g.full
        ),
        "partitioned_full_bytes": sum(g.nbytes for g in part),
        "memory": engine.memory_summary(),
        "frozen_bytes": sum(p.numel() * p.element_size() for p in engine.module.frozen.parameters()),
        "grad_shard_bytes": sum(layout.shard_numel for layout in st.layouts) * 4,
        "tied_kept": engine.module.head.weight is engine.module.emb.weight
        and engine.module.blocks[3].fc1.weight is engine.module.blocks[0].fc1.weight,
        "root_has_tied_block_weight": "blocks.0.fc1.weight" in st.groups[0].param_names(),
    }


def compare(ref: M.Ref, masters: dict, compute: dict) -> dict:
    return {
        "master_err": {
            n: [float((masters[n] - ref.master[n]).abs().max()), float(ref.master[n].abs().max())]
            for n in masters
        },
        "compute_err": {
            n: [
                float((compute[n] - ref.compute[n].float()).abs().max()),
                float(ref.compute[n].float().abs().max()),
            ]
            for n in ref.compute
            if n in compute
        },
    }


def full_params(engine) -> dict[str, torch.Tensor]:
    """Full compute-dtype parameters via module.state_dict() (collective at stage 3)."""
    sd = engine.module.state_dict()
    return {k: v.float().cpu() for k, v in sd.items()}


def run_equivalence(
    name: str, dtype: str, accum: int, clip: float, rank: int, world: int, *, build: str = "plain"
) -> dict | None:
    seed = 1000 + zlib.crc32(name.encode()) % 1000
    steps = 3
    if build == "init":
        with zerorun.zero.Init(config=config(dtype, accum, clip)):
            torch.manual_seed(seed)
            model = M.S3Net()
    elif build == "load":
        model = M.make_model(seed + 7)  # different weights, replaced below
    else:
        model = M.make_model(seed)
        model.reentrant = build == "reentrant"
    engine, *_ = zerorun.initialize(model=model, config=config(dtype, accum, clip))
    if build == "load":
        engine.module.load_state_dict(M.make_model(seed).state_dict())
    result = train(engine, model, seed=seed, rank=rank, steps=steps, accum=accum)
    result.update(structure(engine))
    masters = gather_masters(engine)
    compute = full_params(engine)
    engine.destroy()
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank != 0:
        return None
    ref = M.reference(
        M.make_model(seed),
        dtype=DTYPES[dtype],
        world=world,
        steps=steps,
        accum=accum,
        micro_batch=MICRO,
        seed=seed,
        clip=clip,
        lr=LR,
        weight_decay=WD,
        device=engine.device,
    )
    out = {"ranks": gathered, "ref_losses": ref.losses, "ref_evals": ref.eval_losses, "ref_norms": ref.norms}
    out.update(compare(ref, masters, compute))
    out["frozen_equal"] = bool(
        torch.equal(compute["frozen.weight"], M.make_model(seed).frozen.weight.to(DTYPES[dtype]).float())
    )
    return out


def run_init_equal(rank: int, world: int) -> dict:
    """zero.Init construction == normal construction with the same seed, bit for bit."""
    with zerorun.zero.Init(config=config("fp32", 1, 0.0)):
        torch.manual_seed(77)
        model = M.S3Net()
    # right shape, unwritable, NaN (init.py)
    placeholders = all(
        p.shape == p._zerorun_init.shape and bool(torch.isnan(p).all()) for p in model.parameters()
    )
    ref = M.make_model(77).state_dict()
    got = model.state_dict()  # collective: full tensors
    same = all(torch.equal(got[k].float().cpu(), ref[k].float()) for k in ref)
    with zerorun.zero.GatheredParameters(list(model.parameters())):
        shapes_ok = all(tuple(p.shape) == tuple(ref[n].shape) for n, p in model.named_parameters())
    # The repo's GPT initializes in its root __init__ (nn.init on children already partitioned,
    # branching on p.dim() and names): still bit-identical.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from examples.gpt_model import GPT, get_config

    with zerorun.zero.Init(config=config("fp32", 1, 0.0)):
        torch.manual_seed(78)
        gpt = GPT(get_config("tiny"))
    torch.manual_seed(78)
    gpt_ref = GPT(get_config("tiny")).state_dict()
    gpt_got = gpt.state_dict()
    gpt_same = all(torch.equal(gpt_got[k].float().cpu(), gpt_ref[k].float()) for k in gpt_ref)
    # remote_device="cpu": slices kept in host memory; module=...: partition a built model
    with zerorun.zero.Init(config=config("fp32", 1, 0.0), remote_device="cpu"):
        torch.manual_seed(77)
        on_host = M.S3Net()
    host_ok = all(p._zerorun_init.shard.device.type == "cpu" for p in on_host.parameters())
    host_same = all(torch.equal(v.float().cpu(), ref[k].float()) for k, v in on_host.state_dict().items())
    built = M.make_model(77)
    zerorun.zero.Init(module=built)
    module_same = all(p.numel() == 0 or hasattr(p, "_zerorun_init") for p in built.parameters()) and all(
        torch.equal(v.float().cpu(), ref[k].float()) for k, v in built.state_dict().items()
    )
    # A zero.Init model trained at stage 2: made whole again, trains like a normally built one.
    stage2 = []
    for built_under_init in (True, False):
        cfg2 = config("fp32", 1, 0.0)
        cfg2["zero_optimization"] = {"stage": 2, "reduce_bucket_size": 200}
        if built_under_init:
            with zerorun.zero.Init(config=config("fp32", 1, 0.0)):
                torch.manual_seed(79)
                m2 = M.S3Net()
        else:
            m2 = M.make_model(79)
        e2, *_ = zerorun.initialize(model=m2, config=cfg2)
        stage2.append(train(e2, m2, seed=79, rank=rank, steps=1, accum=1)["losses"])
        e2.destroy()
    shard_numel = sum(p._zerorun_init.shard_numel for p in model.parameters())
    total = sum(v.numel() for v in ref.values() if True)
    return {
        "placeholders": placeholders,
        "gpt_same": gpt_same,
        "stage2_same": stage2[0] == stage2[1],
        "host_ok": host_ok and host_same,
        "module_same": module_same,
        "same": same,
        "shapes_ok": shapes_ok,
        "shard_numel": shard_numel,
        "total": total,
    }


def run_gathered(rank: int, world: int) -> dict:
    """GatheredParameters read and modify (modifier_rank=0) on a stage-3 engine; the masters
    follow, so the next step starts from the modified value."""
    seed = 55
    model = M.make_model(seed)
    engine, *_ = zerorun.initialize(model=model, config=config("bf16", 1, 0.0))
    w = engine.module.blocks[2].fc1.weight
    released_shape = tuple(w.shape)
    with zerorun.zero.GatheredParameters(w):
        read_ok = bool(
            torch.equal(w.float().cpu(), M.make_model(seed).blocks[2].fc1.weight.to(torch.bfloat16).float())
        )
        w.data.fill_(float(rank + 5))  # read-only: discarded
    with zerorun.zero.GatheredParameters(w):
        discarded = bool(
            torch.equal(w.float().cpu(), M.make_model(seed).blocks[2].fc1.weight.to(torch.bfloat16).float())
        )
    with zerorun.zero.GatheredParameters([w, engine.module.blocks[2].fc1.bias], modifier_rank=0):
        w.data.fill_(0.25 if rank == 0 else -1.0)
    with zerorun.zero.GatheredParameters(w):
        modified = bool((w.float() == 0.25).all())
    masters = gather_masters(engine)
    master_ok = bool((masters["blocks.2.fc1.weight"] == 0.25).all())
    other_ok = bool(torch.equal(masters["blocks.2.fc2.weight"], M.make_model(seed).blocks[2].fc2.weight))
    # GatheredParameters inside a group's own forward (already gathered) leaves it gathered.
    def peek(mod, _args):  # noqa: ANN001, ANN202
        with zerorun.zero.GatheredParameters(mod.fc1.weight):
            pass

    handle = engine.module.blocks[1].register_forward_pre_hook(peek)
    ids, tgt = M.batch(seed, 0, 0, rank, MICRO)
    loss = engine(ids.to(engine.device), tgt.to(engine.device))
    engine.backward(loss)
    engine.step()
    handle.remove()
    inside_forward_ok = bool(torch.isfinite(loss).item())
    # Mistakes get clear errors naming the key / file.
    errors = []
    bad = M.make_model(seed).state_dict()
    bad["blocks.2.fc1.weight"] = torch.zeros(3, 3)
    try:
        engine.module.load_state_dict(bad)
    except RuntimeError as exc:
        errors.append("size mismatch for blocks.2.fc1.weight" in str(exc))
    try:
        zerorun.zero.load_pretrained(engine.module, "/nonexistent/weights.safetensors")
    except RuntimeConfigError as exc:
        errors.append("/nonexistent/weights.safetensors" in str(exc))
    engine.destroy()
    # GatheredParameters on a zero.Init model (before initialize): modify on rank 0.
    with zerorun.zero.Init(config=config("fp32", 1, 0.0)):
        torch.manual_seed(seed)
        early = M.S3Net()
    with zerorun.zero.GatheredParameters(early.blocks[1].fc2.weight, modifier_rank=0):
        early.blocks[1].fc2.weight.data.fill_(0.5 if rank == 0 else 9.0)
    init_modified = bool((early.state_dict()["blocks.1.fc2.weight"] == 0.5).all())
    return {
        "errors": errors,
        "init_modified": init_modified,
        "inside_forward_ok": inside_forward_ok,
        "released_shape": list(released_shape),
        "read_ok": read_ok,
        "discarded": discarded,
        "modified": modified,
        "master_ok": master_ok,
        "other_master_exact": other_ok,
    }


def run_safetensors(rank: int, world: int, tmp: str) -> dict:
    """Pretrained weights from a safetensors file into a zero.Init model, slice by slice, then
    training equals training the pretrained model."""
    from safetensors.torch import save_file

    seed = 66
    path = Path(tmp) / "pretrained.safetensors"
    if rank == 0:
        sd = M.make_model(seed).state_dict()
        sd.pop("head.weight")  # tied: stored once, as Hugging Face does
        sd.pop("blocks.3.fc1.weight")
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    dist.barrier()
    with zerorun.zero.Init(config=config("fp32", 1, 0.0)):
        torch.manual_seed(seed + 1)
        model = M.S3Net()
    missing = zerorun.zero.load_pretrained(model, path)
    engine, *_ = zerorun.initialize(model=model, config=config("fp32", 1, 0.0))
    res = train(engine, model, seed=seed, rank=rank, steps=2, accum=1)
    masters = gather_masters(engine)
    engine.destroy()
    ref = M.reference(
        M.make_model(seed),
        dtype=torch.float32,
        world=world,
        steps=2,
        accum=1,
        micro_batch=MICRO,
        seed=seed,
        clip=0.0,
        lr=LR,
        weight_decay=WD,
        device=engine.device,
    )
    err = max(float((masters[n] - ref.master[n]).abs().max()) for n in masters)
    return {
        "missing": missing,
        "master_err": err,
        "losses": res["losses"],
        "ref_losses": [ref.losses[s][0][rank] for s in range(2)],
    }


def run_limits(rank: int, world: int) -> dict:
    """Tight stage3_max_live_parameters / prefetch bucket: gathered elements never exceed the
    live limit plus one group; with the default-style reuse distance blocks are kept."""
    out = {}
    for label, zero in {
        "tight": {"stage3_max_live_parameters": 2000, "stage3_prefetch_bucket_size": 400},
        "no_prefetch": {"stage3_prefetch_bucket_size": 0},
        "keep": {"stage3_max_reuse_distance": 1_000_000_000},
    }.items():
        model = M.make_model(3)
        cfg = config("fp32", 1, 0.0, **zero)
        engine, *_ = zerorun.initialize(model=model, config=cfg)
        res = train(engine, model, seed=3, rank=rank, steps=2, accum=1)
        out[label] = {
            **structure(engine),
            "losses": res["losses"],
            "max_live": zero.get("stage3_max_live_parameters"),
        }
        engine.destroy()
    cfg = config("fp32", 1, 0.0)
    cfg["zerorun"] = {"stage3_reshard_after_forward": False}
    model = M.make_model(3)
    engine, *_ = zerorun.initialize(model=model, config=cfg)
    res = train(engine, model, seed=3, rank=rank, steps=2, accum=1)
    out["no_reshard"] = {**structure(engine), "losses": res["losses"]}
    engine.destroy()
    cfg = config("fp32", 1, 0.0)
    cfg["zerorun"] = {"stage3_group_modules": ["Linear"]}
    model = M.make_model(3)
    engine, *_ = zerorun.initialize(model=model, config=cfg)
    res = train(engine, model, seed=3, rank=rank, steps=2, accum=1)
    out["by_class"] = {**structure(engine), "losses": res["losses"]}
    engine.destroy()
    return out


def run_fp16_overflow(rank: int, world: int) -> dict:
    """An inf loss on the last rank at step 1: every rank skips that step (the engine's rule,
    through stage 3's gradient shards) and parameters stay exactly as they were."""
    cfg = config("fp32", 1, CLIP)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 10, "hysteresis": 1, "loss_scale_window": 100}
    model = M.make_model(8)
    engine, *_ = zerorun.initialize(model=model, config=cfg)
    sums, scales = [], []
    for step in range(3):
        before = sum(float(m.double().sum()) for m in engine.stage.state.masters)
        ids, tgt = M.batch(8, step, 0, rank, MICRO)
        loss = engine(ids.to(engine.device), tgt.to(engine.device))
        engine.backward(loss * float("inf") if (step == 1 and rank == world - 1) else loss)
        engine.step()
        sums.append([before, sum(float(m.double().sum()) for m in engine.stage.state.masters)])
        scales.append(engine.get_loss_scale())
    engine.destroy()
    return {"skipped": engine.skipped_steps, "sums": sums, "scales": scales}


def run_order_check(rank: int, world: int) -> dict:
    """Ranks taking different branches in one step: the debug check names the modules."""
    cfg = config("fp32", 1, 0.0)
    cfg["zerorun"] = {"stage3_check_order": True}
    model = M.make_model(4)
    engine, *_ = zerorun.initialize(model=model, config=cfg)
    model.flip = rank == 1
    ids, tgt = M.batch(4, 0, 0, rank, MICRO)
    try:
        engine(ids.to(engine.device), tgt.to(engine.device))
        return {"raised": False}
    except RuntimeConfigError as exc:
        return {"raised": True, "message": str(exc)}
    finally:
        engine.destroy()


def main() -> None:
    out_path = Path(sys.argv[1])
    torch.use_deterministic_algorithms(True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results: dict = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_shared = str(out_path.parent) if tmp else tmp
        # ZR_S3_CASES (comma list) narrows the matrix (test_stage3_schedule.py's extra launch).
        only = set(filter(None, os.environ.get("ZR_S3_CASES", "").split(",")))
        for dtype, accum, clip in product(("fp32", "bf16"), (1, 4), (0.0, CLIP)):
            name = f"{dtype}-ga{accum}-clip{clip:g}"
            if only and name not in only:
                continue
            t = time.monotonic()
            r = run_equivalence(name, dtype, accum, clip, rank, world)
            if r is not None:
                r["seconds"] = time.monotonic() - t
                results[name] = r
        if world > 1:
            for build in ("init", "load", "reentrant"):
                r = run_equivalence(f"{build}-bf16", "bf16", 1, CLIP, rank, world, build=build)
                if r is not None:
                    results[f"build-{build}"] = r
            extras = {
                "init_equal": lambda: run_init_equal(rank, world),
                "gathered": lambda: run_gathered(rank, world),
                "safetensors": lambda: run_safetensors(rank, world, tmp_shared),
                "limits": lambda: run_limits(rank, world),
                "fp16_overflow": lambda: run_fp16_overflow(rank, world),
                "order_check": lambda: run_order_check(rank, world),
            }
            for key, fn in extras.items():
                r = fn()
                gathered = [None] * world
                dist.all_gather_object(gathered, r)
                if rank == 0:
                    results[key] = gathered
    if rank == 0:
        results["_total_seconds"] = time.monotonic() - t0
        out_path.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
