"""What stage 3 and FSDP2 hold at the memory peak of a training step, measured on CPU ranks.

Every allocation and free of one training step (after warm-up) is recorded by torch's profiler
(``profile_memory``: the CPU allocator reports each one, like CUDA's caching allocator counts
``memory_allocated``). From that timeline: the peak, and the tensors alive at that instant, each
named by the operator that allocated it and classed by size (a whole block's parameters in the
compute dtype, the same in fp32, the root group's, ...). Markers at each block's forward and
backward say where in the step the peak falls.

    python -m benchmarks.stage3_memory_trace --system zerorun [--world 2] [--set KEY=VALUE ...]
    python -m benchmarks.stage3_memory_trace --system fsdp2

The model is the benchmark's GPT (workload.py) at a small size whose proportions follow the
1.34B reference (activations per block / a block's parameters ~ 11; vocabulary / hidden ~ 16;
stage-3 knobs scaled by a block's size: persistence threshold below every matrix and above
every LayerNorm, prefetch bucket just under one block, reuse distance DeepSpeed's 1e9 scaled
to ~20 blocks). zerorun runs its real collective path at world 1 (``ZERORUN_DEBUG_COLLECTIVES=1``).
Prints one JSON object (``--out`` also writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.workload import BETAS, EPS, LR, WEIGHT_DECAY, adamw, build_model, gpt_model

__all__ = ["main"]

# The 1.34B reference scaled down: d=256 (12 * 256^2 = 786,432 elements per block), tokens per
# micro-batch / d = 7 (the reference has 16,384 / 2,048), vocabulary / d ~ 16.
CFG = gpt_model.GPTConfig(n_layer=8, d_model=256, n_head=4, vocab_size=4096, seq_len=224, micro_batch=8)
BLOCK_NUMEL = 12 * CFG.d_model**2
REFERENCE_BLOCK = 12 * 2048**2


def _scaled(value: float) -> int:
    """A stage-3 knob of the reference (in elements) at this model's block size."""
    return int(value * BLOCK_NUMEL / REFERENCE_BLOCK)


def zerorun_config(overrides: dict[str, Any]) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "stage3_param_persistence_threshold": 1000,
        "stage3_prefetch_bucket_size": _scaled(5e7),
        "stage3_max_live_parameters": _scaled(1e9),
        "stage3_max_reuse_distance": _scaled(1e9),
    }
    zero.update(overrides)
    return {
        "train_micro_batch_size_per_gpu": CFG.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        },
        "bf16": {"enabled": True},
        "zero_optimization": zero,
    }


class _Marks:
    """record_function markers at each block's forward start/end and backward start/end."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.handles = []
        for i, block in enumerate(model.blocks):  # type: ignore[union-attr]
            self.handles.append(block.register_forward_pre_hook(self._mark(f"fwd{i}")))
            self.handles.append(block.register_forward_hook(self._mark(f"fwd{i}.end")))
            self.handles.append(block.register_full_backward_pre_hook(self._mark(f"bwd{i}")))
            self.handles.append(block.register_full_backward_hook(self._mark(f"bwd{i}.end")))

    @staticmethod
    def _mark(name: str) -> Any:
        def hook(*_a: Any) -> None:
            with torch.profiler.record_function(f"mark:{name}"):
                pass

        return hook


def _flatten(events: list[Any]) -> list[Any]:
    out, stack = [], list(events)
    while stack:
        e = stack.pop()
        out.append(e)
        stack.extend(e.children)
    return out


def _alloc_owner(e: Any) -> str:
    """The allocation's three innermost enclosing events ("aten::mm < aten::matmul < ..."; "?"
    for none: zerorun's gather buffers are resized outside any operator)."""
    names = []
    q = e.parent
    while q is not None and len(names) < 3:
        names.append(q.name)
        q = q.parent
    return " < ".join(names) or "?"


def analyse(prof: Any, sizes: dict[int, str]) -> dict[str, Any]:
    from torch._C._profiler import _EventType

    events = _flatten(prof.profiler.kineto_results.experimental_event_tree())
    allocs = sorted(
        (e for e in events if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"),
        key=lambda e: e.start_time_ns,
    )
    marks = sorted(
        ((e.start_time_ns, e.name[5:]) for e in events if e.name.startswith("mark:")), key=lambda m: m[0]
    )
    live: dict[int, tuple[int, Any]] = {}
    base = allocs[0].extra_fields.total_allocated - allocs[0].extra_fields.alloc_size if allocs else 0
    cur = base
    peak, peak_i, peak_live = base, -1, dict(live)
    timeline = []
    for i, e in enumerate(allocs):
        f = e.extra_fields
        size = f.alloc_size
        cur += size
        if size > 0:
            live[f.ptr] = (size, e)
        else:
            live.pop(f.ptr, None)
        if cur > peak:
            peak, peak_i, peak_live = cur, i, dict(live)
        timeline.append((e.start_time_ns, cur))
    # Bytes allocated at each marker (the last allocation before it).
    at_marks = []
    j = 0
    last = base
    for t, name in marks:
        while j < len(timeline) and timeline[j][0] <= t:
            last = timeline[j][1]
            j += 1
        at_marks.append((name, last))
    peak_t = allocs[peak_i].start_time_ns if peak_i >= 0 else 0
    where = next((name for t, name in reversed(marks) if t <= peak_t), "before the first block")
    classes: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, e in peak_live.values():
        key = f"{sizes.get(size, 'other')} ({_alloc_owner(e)})"
        classes[key][0] += 1
        classes[key][1] += size
    top = sorted(classes.items(), key=lambda kv: -kv[1][1])
    # gloo on CPU copies through its own buffers, alive until the work is waited for (an
    # asynchronous prefetch's); NCCL writes straight into the output: left out of the comparison.
    gloo = sum(size for size, e in peak_live.values() if "gloo:" in _alloc_owner(e))
    return {
        "peak_bytes_step": peak,
        "gloo_internal_at_peak": gloo,
        "peak_bytes_step_without_gloo_internal": peak - gloo,
        "peak_after_mark": where,
        "allocated_before_step": base,
        "live_at_peak_allocated_in_step": sum(s for s, _ in peak_live.values()),
        "live_at_peak": [{"what": k, "count": c, "bytes": b} for k, (c, b) in top[:20]],
        "at_marks": at_marks,
    }


def _size_names(model: torch.nn.Module) -> dict[int, str]:
    block = sum(p.numel() for p in model.blocks[0].parameters() if p.numel() > 1000)  # type: ignore[index]
    root = sum(
        p.numel()
        for n, p in model.named_parameters()
        if not n.startswith("blocks.") and p.numel() > 1000
    )
    names = {}
    for numel, what in ((block, "block"), (root, "root group")):
        names[numel * 2] = f"{what} params, bf16"
        names[numel * 4] = f"{what} params/grads, fp32"
    t = CFG.micro_batch * CFG.seq_len
    names[t * CFG.vocab_size * 2] = "logits-sized, bf16"
    names[t * CFG.vocab_size * 4] = "logits-sized, fp32"
    return names


def run(system: str, overrides: dict[str, Any], steps: int) -> dict[str, Any]:
    device = torch.device("cpu")
    rank = int(os.environ.get("RANK", "0"))
    model = build_model(CFG, device, seed=1234)
    sizes = _size_names(model)
    data = gpt_model.SyntheticTokens(CFG, CFG.micro_batch, device, seed=1234, rank=rank)
    if system == "zerorun":
        import zerorun

        engine, _, _, _ = zerorun.initialize(model=model, config=zerorun_config(overrides))

        def step(i: int) -> float:
            x, y = data.batch(i)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return float(loss)

        marked = engine.module
    else:
        import torch.distributed as dist

        from benchmarks.peers import fsdp2_api

        if not dist.is_initialized():
            if "RANK" in os.environ:
                dist.init_process_group("gloo")
            else:
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        fully_shard, mp_cls, _ = fsdp2_api()
        kw = {"mp_policy": mp_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        opt = adamw(model.parameters(), device)

        def step(i: int) -> float:
            x, y = data.batch(i)
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss)

        marked = model
    losses = [step(i) for i in range(steps)]
    marks = _Marks(marked)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        losses.append(step(steps))
    for h in marks.handles:
        h.remove()
    out = analyse(prof, sizes)
    out.update(
        system=system,
        overrides=overrides,
        world=int(os.environ.get("WORLD_SIZE", "1")),
        losses=losses,
        block_numel=BLOCK_NUMEL,
    )
    if system == "zerorun":
        stage = engine.stage
        out["schedule"] = {
            "peak_live_numel": stage.schedule.peak_live_numel,
            "prefetches": stage.schedule.prefetches,
            "peak_staging_bytes": stage.hooks.peak_staging_bytes,
            "groups": [(g.name, g.numel, g.resident) for g in stage.groups],
        }
    return out


# The committed comparison (benchmarks/results/stage3_memory_trace_cpu.json, docs/stage3.md):
# (label, system, world, zero_optimization overrides, environment)
SUITE: list[tuple[str, str, int, dict[str, Any], dict[str, str]]] = [
    ("fsdp2 world 1", "fsdp2", 1, {}, {}),
    ("zerorun world 1, real collectives", "zerorun", 1, {}, {"ZERORUN_DEBUG_COLLECTIVES": "1"}),
    ("zerorun world 1, default (no collectives)", "zerorun", 1, {}, {"ZERORUN_DEBUG_COLLECTIVES": "0"}),
    ("fsdp2 world 2", "fsdp2", 2, {}, {}),
    ("zerorun world 2, reuse distance 1e9 (DeepSpeed's default)", "zerorun", 2, {}, {}),
    ("zerorun world 2, reuse distance 0", "zerorun", 2, {"stage3_max_reuse_distance": 0}, {}),
]


def suite(out: Path) -> int:
    """Every SUITE case in its own process(es); one JSON file of all results."""
    import subprocess
    import tempfile

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, system, world, overrides, env) in enumerate(SUITE):
            path = Path(tmp) / f"{i}.json"
            cmd = [sys.executable, "-m", "benchmarks.stage3_memory_trace", "--system", system]
            cmd += ["--world", str(world), "--out", str(path)]
            for k, v in overrides.items():
                cmd += ["--set", f"{k}={json.dumps(v)}"]
            rc = subprocess.run(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL).returncode
            if rc != 0:
                print(f"{label}: exit {rc}", file=sys.stderr)
                return rc
            r = json.loads(path.read_text())
            r["label"] = label
            results.append(r)
            print(f"{label}: peak {r['peak_bytes_step_without_gloo_internal']:,} B after {r['peak_after_mark']}")
    doc = {
        "what": "bytes allocated during one training step (after 2 warm-up steps), at its peak; CPU ranks",
        "command": "python -m benchmarks.stage3_memory_trace --suite --out " + str(out),
        "model": {k: getattr(CFG, k) for k in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len", "micro_batch")},
        "torch": torch.__version__,
        "results": results,
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", choices=["zerorun", "fsdp2"])
    ap.add_argument("--suite", action="store_true", help="run every committed case, write one file (--out)")
    ap.add_argument("--set", action="append", default=[], help="zero_optimization KEY=VALUE (JSON value)")
    ap.add_argument("--steps", type=int, default=2, help="warm-up steps before the traced one")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--world", type=int, default=1, help="gloo ranks (each traces its own step; rank 0 reports)")
    args = ap.parse_args(argv)
    if args.suite:
        return suite(args.out or Path("benchmarks/results/stage3_memory_trace_cpu.json"))
    if args.system is None:
        ap.error("--system or --suite")
    if args.world > 1 and "RANK" not in os.environ:
        return _spawn(args.world, argv if argv is not None else sys.argv[1:])
    torch.set_num_threads(1)
    os.environ.setdefault("ZERORUN_DEBUG_COLLECTIVES", "1")  # the fair world-1 row by default
    overrides = {}
    for kv in args.set:
        k, _, v = kv.partition("=")
        overrides[k] = json.loads(v)
    result = run(args.system, overrides, args.steps)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


def _spawn(world: int, argv: list[str]) -> int:
    """Run this script as ``world`` gloo ranks (torchrun's environment), wait for all."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.stage3_memory_trace", *argv], env=env))
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
