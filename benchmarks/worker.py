"""The body of one configuration's process (every rank runs it): build, train, measure, record.

Two modes:
- `throughput`: warm-up steps, then timed steps; rates, peak memory, losses.
- `memory`: N ranks (typically sharing one GPU over gloo); each rank's
  `torch.cuda.memory_allocated()` at fixed points, compared on rank 0 with the ZeRO formulas
  (`memory_model.py`).

Rank 0 writes the record (JSON) to `result_file`. A rank that fails writes an error record
there instead (if none is there yet) and exits non-zero, so the orchestrator — or a user
running this under `zerorun`/`torchrun` directly — always finds out what happened.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import memory_model
from benchmarks.configs import CATALOGUE, BenchConfig, deep_merge, zerorun_ds_config
from benchmarks.measure import (
    Trainer,
    device_memory,
    host_rss_peak_bytes,
    live_tensor_bytes,
    peak_bf16_flops,
    profile_steps,
    run_steps,
    throughput,
)
from benchmarks.rankenv import RankContext, gather_objects, init_process_group, rank_context, synchronize
from benchmarks.results import SCHEMA
from benchmarks.workload import BETAS, EPS, LR, WEIGHT_DECAY, build_model, gpt_model

__all__ = ["WorkerArgs", "run_worker", "Unavailable", "Skipped"]


class Skipped(Exception):
    """The configuration does not apply here (e.g. CPU offload on a machine without a GPU)."""


class Unavailable(Exception):
    """zerorun (or the piece this configuration needs) is not there yet."""


@dataclass
class WorkerArgs:
    config: str
    size: str
    result_file: str
    run_id: str
    mode: str = "throughput"  # or "memory"
    seq_len: int | None = None
    micro_batch: int | None = None
    warmup: int = 3
    steps: int = 10
    seed: int = 1234
    device: str = "auto"
    ranks_per_gpu: int | None = None
    pg_timeout_s: float = 300.0
    peak_tflops: float | None = None
    zerorun_override: str | None = None  # JSON merged into the zerorun config
    profile: int = 0  # extra steps under torch.profiler after the timed ones (0: none)
    profile_dir: str | None = None  # where rank 0 writes a Chrome trace (optional)
    repeat: int = 1


def _environment(ctx: RankContext) -> dict[str, Any]:
    cuda = ctx.device.type == "cuda"
    import zerorun

    return {
        "device": ctx.device.type,
        "gpu_name": torch.cuda.get_device_name(ctx.device) if cuda else None,
        "gpu_count_visible": torch.cuda.device_count() if cuda else 0,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "zerorun_version": getattr(zerorun, "__version__", None),
        "hostname": platform.node(),
    }


def _make_trainer(
    bench: BenchConfig, model: torch.nn.Module, ctx: RankContext, ds_config: dict[str, Any] | None
) -> Trainer:
    from benchmarks import peers

    if bench.needs_cuda and ctx.device.type != "cuda":
        raise Skipped(f"{bench.name} needs a CUDA device")
    if bench.family == "plain":
        return peers.PlainTrainer(model, ctx)
    if bench.family == "ddp":
        return peers.DDPTrainer(model, ctx)
    if bench.family == "fsdp2":
        return peers.FSDP2Trainer(model, ctx, cpu_offload=bench.cpu_offload)
    assert ds_config is not None
    from benchmarks.zerorun_trainer import ZerorunTrainer

    try:
        return ZerorunTrainer(model, ds_config)
    except (ModuleNotFoundError, NotImplementedError) as e:
        # zerorun.initialize or a piece it needs does not exist yet: recorded as such. Any
        # other exception is a real error and recorded as one.
        raise Unavailable(f"{type(e).__name__}: {e}") from e


def _ds_config(bench: BenchConfig, args: WorkerArgs, micro_batch: int) -> dict[str, Any] | None:
    if bench.family != "zerorun":
        return None
    override = json.loads(args.zerorun_override) if args.zerorun_override else None
    if args.mode == "memory":
        # Explicit buffers sized from the model (1/16 of Ψ each), so the formula's terms dominate
        # and the buffer allowance (from the config alone) stays small beside them; and every
        # parameter partitioned at stage 3 (persistence threshold 0: with the default 1e5 the
        # tiny model's largest parameter stayed replicated and stage 3 equalled stage 2).
        cfg = gpt_model.get_config(args.size, **({"seq_len": args.seq_len} if args.seq_len else {}))
        bucket = max(4096, gpt_model.count_parameters(cfg) // 16)
        zero_bufs = {
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "stage3_prefetch_bucket_size": bucket,
            "stage3_max_live_parameters": 4 * bucket,
            "stage3_param_persistence_threshold": 0,
        }
        override = {"zero_optimization": zero_bufs, **(override or {})}
    if bench.delayed_update and "delayed_param_update_warmup" not in (override or {}).get("zerorun", {}):
        # The timed steps must be delayed ones: the exact warm-up is the run's own untimed
        # warm-up (the default, 40 steps, would time exact steps). Convergence with the default
        # is benchmarks/dpu_convergence.py's.
        override = deep_merge(override or {}, {"zerorun": {"delayed_param_update_warmup": args.warmup}})
    return zerorun_ds_config(
        bench,
        micro_batch=micro_batch,
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WEIGHT_DECAY,
        override=override,
    )


def _throughput(
    args: WorkerArgs, bench: BenchConfig, ctx: RankContext, record: dict[str, Any]
) -> dict[str, Any]:
    cfg = gpt_model.get_config(args.size, **({"seq_len": args.seq_len} if args.seq_len else {}))
    mb = args.micro_batch or cfg.micro_batch
    ds_config = _ds_config(bench, args, mb)
    record.update(zerorun_config=ds_config, micro_batch=mb, seq_len=cfg.seq_len)
    model = build_model(cfg, ctx.device, args.seed)
    record["n_params"] = sum(p.numel() for p in model.parameters())
    if bench.compile:
        for block in model.blocks:  # compiled in the first (untimed) warm-up step
            block.compile()
    trainer = _make_trainer(bench, model, ctx, ds_config)
    del model  # the trainer owns it now; no stray reference keeps fp32 weights alive
    data = gpt_model.SyntheticTokens(cfg, mb, ctx.device, seed=args.seed, rank=ctx.rank)
    batches = [data.batch(i) for i in range(args.warmup + args.steps)]
    timing = run_steps(trainer, batches, args.warmup, ctx.device)
    profile_table = None
    if args.profile > 0:
        n = args.warmup + args.steps
        trace = None
        if args.profile_dir and ctx.is_main:
            Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
            trace = str(Path(args.profile_dir) / f"{args.run_id}__{bench.name}.trace.json")
        extra = [data.batch(n + i) for i in range(args.profile)]
        profile_table = profile_steps(trainer, extra, ctx.device, trace)
    mine = {
        "step_times_s": timing.step_times_s,
        "losses": timing.losses,
        "loop_wall_s": timing.loop_wall_s,
        "gpu_memory": device_memory(ctx.device),
        "host_rss_peak_bytes": host_rss_peak_bytes(),
        "engine_memory": trainer.memory_report(),
        "offload_profile": getattr(trainer, "offload_profile", lambda: None)(),
    }
    ranks = gather_objects(ctx, mine)
    if not ctx.is_main:
        return record
    # A step is over when its slowest rank is.
    step_times = [max(r["step_times_s"][i] for r in ranks) for i in range(args.steps)]
    losses = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(len(batches))]
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_bf16_flops(record.get("gpu_name"))
    fpt = gpt_model.flops_per_token(cfg)
    record.update(
        throughput(
            step_times,
            tokens_per_step=mb * cfg.seq_len * ctx.world_size,
            world_size=ctx.world_size,
            flops_per_token=fpt,
            peak_flops_per_gpu=peak,
        )
    )

    def _max(key: str) -> int | None:
        values = [r["gpu_memory"][key] for r in ranks if r["gpu_memory"][key] is not None]
        return max(values) if values else None

    record.update(
        step_times_s=step_times,
        loop_wall_s=max(r["loop_wall_s"] for r in ranks),
        tokens_per_step=mb * cfg.seq_len * ctx.world_size,
        flops_per_token=fpt,
        flop_formula="72*L*d^2 + 12*L*s*d + 6*V*d per token (Megatron-LM, no recompute)",
        peak_flops_per_gpu=peak,
        losses=losses,
        final_loss=losses[-1],
        gpu_mem_peak_allocated_bytes=_max("peak_allocated"),
        gpu_mem_peak_reserved_bytes=_max("peak_reserved"),
        host_rss_peak_bytes=max(r["host_rss_peak_bytes"] for r in ranks),
        per_rank_gpu_memory=[r["gpu_memory"] for r in ranks],
        per_rank_host_rss_peak_bytes=[r["host_rss_peak_bytes"] for r in ranks],
        engine_memory=ranks[0]["engine_memory"],
        offload_profile=ranks[0]["offload_profile"],  # rank 0's last step (seconds by phase)
        profile_top_ops=profile_table,  # rank 0's; steps after the timed ones, not in the losses
    )
    return record


def _memory(args: WorkerArgs, bench: BenchConfig, ctx: RankContext, record: dict[str, Any]) -> dict[str, Any]:
    if bench.family != "zerorun" or bench.stage is None:
        raise Skipped("memory mode compares zerorun's partitions with the ZeRO formulas")
    cfg = gpt_model.get_config(args.size, **({"seq_len": args.seq_len} if args.seq_len else {}))
    mb = args.micro_batch or 1
    ds_config = _ds_config(bench, args, mb)
    assert ds_config is not None
    record.update(zerorun_config=ds_config, micro_batch=mb, seq_len=cfg.seq_len)
    # Measured side: the CUDA caching allocator; on CPU (no allocator statistics) a census of
    # live tensors. Both are independent of zerorun's own report. The census is kept on CUDA
    # too: allocator minus census is memory Python cannot see (C++-side buffers).
    on_cuda = ctx.device.type == "cuda"
    points: dict[str, int | None] = {}
    census: dict[str, int] = {}
    host_census: dict[str, int] = {}  # CPU tensors (offloaded states live there)

    def mark(name: str) -> None:
        synchronize(ctx.device)
        census[name] = live_tensor_bytes(ctx.device)
        points[name] = device_memory(ctx.device)["allocated"] if on_cuda else census[name]
        host_census[name] = live_tensor_bytes(torch.device("cpu")) if on_cuda else census[name]

    model = build_model(cfg, ctx.device, args.seed)
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    mark("model_built_fp32")
    trainer = _make_trainer(bench, model, ctx, ds_config)
    del model
    gc.collect()
    mark("after_initialize")
    data = gpt_model.SyntheticTokens(cfg, mb, ctx.device, seed=args.seed, rank=ctx.rank)
    n_steps = max(2, args.warmup + args.steps)
    losses = []
    for i in range(n_steps):
        x, y = data.batch(i)
        losses.append(trainer.forward_backward(x, y))
        del x, y
        mark(f"after_backward_{i}")
        trainer.optimizer_step()
        mark(f"after_step_{i}")
    report = trainer.memory_report()
    mine = {
        "points": points,
        "census": census,
        "host_census": host_census,
        "host_rss_peak_bytes": host_rss_peak_bytes(),
        "engine_memory": report,
        "peak_allocated": device_memory(ctx.device)["peak_allocated"],
    }
    ranks = gather_objects(ctx, mine)
    if not ctx.is_main:
        return record
    zero = ds_config["zero_optimization"]
    formula = memory_model.model_state_bytes(
        psi,
        ctx.world_size,
        bench.stage,
        grad_bytes=memory_model.grad_bytes_of(ds_config),
        offload_optimizer="offload_optimizer" in zero,
        offload_param="offload_param" in zero,
    )
    reported = memory_model.reported_buffer_bytes(report, ctx.device.type)  # recorded, not used
    # The band's upper edge: the formula + the buffers the config allows (config arithmetic
    # only; zerorun's report about itself would make the check partly circular).
    config_buffers = memory_model.config_buffer_bytes(ds_config, psi, ctx.world_size)
    buffers = config_buffers["total"]
    # On CPU the "device" is the host: offloaded terms stay in what is measured.
    device_formula = formula["gpu"]["total"] + (0.0 if on_cuda else formula["host"]["total"])
    device_between_steps = formula["gpu"]["between_steps"] + (
        0.0 if on_cuda else formula["host"]["between_steps"]
    )
    last = n_steps - 1
    checked = f"after_backward_{last}"
    checks = {}
    # After backward (optimizer states exist from the first step on, gradients are all there,
    # activations are freed) every term of the formula is alive: that is the checked point;
    # after the step (GPU gradients freed: the between-steps formula) is recorded beside it.
    for point, expected in ((checked, device_formula), (f"after_step_{last}", device_between_steps)):
        measured = [r["points"][point] for r in ranks]
        if all(m is not None for m in measured):
            checks[point] = memory_model.band_check(measured, expected, buffers, 0.05)
    # Offloaded terms on the host: Python-visible CPU tensors against the formula's host terms
    # (a census, so pinned staging buffers held in C++ would not show); recorded, not checked.
    host_at_check = [r["host_census"][checked] for r in ranks]
    record.update(
        n_params=psi,
        losses=[float(v) for v in torch.stack(losses).float().cpu().tolist()],
        formula_bytes=formula,
        config_buffer_bytes=config_buffers,
        reported_buffer_bytes=reported,
        buffer_allowance_bytes=buffers,
        measured_by="cuda_allocator" if on_cuda else "tensor_census",
        checked_point=checked,
        checks=checks,
        tolerance=0.05,
        within_tolerance=checks[checked]["within"] if checked in checks else None,
        per_rank_points=[r["points"] for r in ranks],
        per_rank_census=[r["census"] for r in ranks],
        per_rank_host_census=[r["host_census"] for r in ranks],
        device_formula_bytes=device_formula,
        host_formula_bytes=formula["host"]["total"],
        host_census_at_check=host_at_check,
        per_rank_peak_allocated=[r["peak_allocated"] for r in ranks],
        host_rss_peak_bytes=max(r["host_rss_peak_bytes"] for r in ranks),
        per_rank_engine_memory=[r["engine_memory"] for r in ranks],
    )
    return record


def _write_once(path: Path, record: dict[str, Any], overwrite: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not overwrite and path.exists():
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def run_worker(args: WorkerArgs) -> int:
    """Run one configuration on this rank; returns the process exit code."""
    bench = CATALOGUE[args.config]
    if bench.real_collectives:  # read when zerorun builds its communicator
        os.environ["ZERORUN_DEBUG_COLLECTIVES"] = "1"
    started = time.time()
    record: dict[str, Any] = {
        "schema": SCHEMA,  # complete on its own: under a launcher this is the final record
        "run_id": args.run_id,
        "config": bench.name,
        "family": bench.family,
        "description": bench.description,
        "mode": args.mode,
        "repeat": args.repeat,
        "size": args.size,
        "seed": args.seed,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "worker_args": asdict(args),
    }
    ctx: RankContext | None = None
    try:
        ctx = rank_context(args.device, args.ranks_per_gpu)
        record.update(
            world_size=ctx.world_size,
            ranks_per_gpu=ctx.ranks_per_gpu,
            backend=ctx.backend,
            **_environment(ctx),
        )
        if ctx.world_size > 1 or bench.family != "plain":
            init_process_group(ctx, args.pg_timeout_s)  # FSDP2 and zerorun need one at world 1 too
        body = _memory if args.mode == "memory" else _throughput
        record = body(args, bench, ctx, record)
        record.update(status="ok", error=None)
    except BaseException as e:  # noqa: BLE001 - every failure must end up in the record
        status = (
            "skipped" if isinstance(e, Skipped) else "unavailable" if isinstance(e, Unavailable) else "error"
        )
        if isinstance(e, KeyboardInterrupt):
            status = "interrupted"
        rank = ctx.rank if ctx else int(os.environ.get("RANK", "0"))
        record.update(
            status=status,
            error=f"{type(e).__name__}: {e}".strip(),
            error_rank=rank,
            traceback=traceback.format_exc(limit=12)[-4000:],
            finished_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            elapsed_s=time.time() - started,
        )
        print(f"[bench {args.config} rank {rank}] {status}: {record['error']}", file=sys.stderr, flush=True)
        _write_once(Path(args.result_file), record, overwrite=False)
        # Leave without tearing down the process group: peers may be stuck in a collective,
        # and the launcher stops them once this rank exits non-zero.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if status == "skipped" else 3)
    record.update(
        finished_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), elapsed_s=time.time() - started
    )
    if ctx.is_main:
        _write_once(Path(args.result_file), record, overwrite=True)
    import torch.distributed as dist

    if dist.is_initialized():
        # Every rank past its last collective before teardown: torch 2.13's gloo can abort a
        # process that tears down while a peer's connection is still in use.
        dist.barrier()
        dist.destroy_process_group()
    return 0
