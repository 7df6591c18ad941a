"""Checkpoint fragments laid out by the runtime's real partition math, without an engine.

`rank_fragments` cuts per-parameter tensors the way a ZeRO stage would (flat buffers from
`zerorun.runtime.partition.plan_flat_buffers`, one shard per rank) so the format and reshard
code can be tested for any world size / bucket layout in one process.
"""

from __future__ import annotations

import torch

from zerorun.runtime.checkpoint.format import BUFFER, WEIGHT, CheckpointMeta, Fragment, ParamInfo
from zerorun.runtime.partition import ParamSpec, plan_flat_buffers


def model_state(sizes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """kind -> name -> full fp32 tensor, deterministic."""
    g = torch.Generator().manual_seed(seed)
    kinds = {WEIGHT: {}, "optim.exp_avg": {}, "optim.exp_avg_sq": {}}
    for name, shape in sizes.items():
        for k in kinds:
            kinds[k][name] = torch.randn(shape, generator=g)
    return kinds


def rank_fragments(
    state: dict[str, dict[str, torch.Tensor]],
    *,
    world_size: int,
    rank: int,
    stage: int,
    bucket_numel: int,
    align: int = 4,
    buffers: dict[str, torch.Tensor] | None = None,
) -> list[Fragment]:
    """Fragments rank `rank` holds; stage 0 holds everything (replicated)."""
    names = list(state[WEIGHT])
    frags: list[Fragment] = []
    if stage == 0:
        for kind, tensors in state.items():
            for n in names:
                t = tensors[n].reshape(-1)
                frags.append(Fragment(n, kind, 0, t.numel(), t, replicated=True))
    else:
        specs = [ParamSpec(n, tuple(state[WEIGHT][n].shape), "float32") for n in reversed(names)]
        for layout in plan_flat_buffers(specs, num_shards=world_size, bucket_numel=bucket_numel, align=align):
            lo, hi = layout.shard_range(rank)
            for kind, tensors in state.items():
                for slot, a, b in layout.pieces_in_range(lo, hi):
                    frags.append(Fragment(slot.name, kind, a, b, tensors[slot.name].reshape(-1)[a:b]))
    for n, t in (buffers or {}).items():
        frags.append(Fragment(n, BUFFER, 0, t.numel(), t.reshape(-1), replicated=True))
    return frags


def meta_for(
    state: dict[str, dict[str, torch.Tensor]],
    *,
    world_size: int,
    stage: int,
    buffers: dict[str, torch.Tensor] | None = None,
    tied: dict[str, str] | None = None,
    precision: str = "fp32",
    param_dtype: str = "float32",
) -> CheckpointMeta:
    return CheckpointMeta(
        world_size=world_size,
        stage=stage,
        precision=precision,
        params=[ParamInfo(n, tuple(t.shape), param_dtype) for n, t in state[WEIGHT].items()],
        buffers=[ParamInfo(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in (buffers or {}).items()],
        tied=dict(tied or {}),
        optimizer={"class": "AdamW"},
        counters={"global_steps": 3},
        kinds=sorted(state),
        tag="global_step3",
    )
