"""One rank (world 1 or 2) of the ZenFlow test (on the training device zerorun picks: CPU here, CUDA on a
GPU machine): each case trains a small model through zerorun with
`zero_optimization.zenflow` and, in the same process, through a plainly written reference of
zerorun's ZenFlow rule (docs/offload.md); rank 0 writes {case: result} for test_offload_zenflow.py.

argv: OUT_JSON. Run by test_offload_zenflow.py via _spawn.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _models  # noqa: E402

import zerorun  # noqa: E402
from zerorun.runtime.offload.host import Copier  # noqa: E402

VOCAB, LR, WD, B1, B2, EPS = 64, 2e-2, 0.01, 0.9, 0.999, 1e-8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# name -> (stage, dtype, clip, accum, steps, (topk_ratio, select_interval (0: once), update_interval, warm-up))
CASES: dict[str, tuple[int, str, float, int, int, tuple[float, int, int, int]]] = {
    "z1-fp32-reselect": (1, "fp32", 0.0, 1, 8, (0.25, 3, 2, 1)),
    "z2-bf16-clip": (2, "bf16", 0.05, 1, 8, (0.3, 4, 2, 0)),
    "z3-fp32-once-ga2": (3, "fp32", 0.0, 2, 6, (0.2, 0, 3, 2)),
    # the placement's copies run as early as a copy stream may run them (EarliestCopies)
    "z2-fp32-early-copies": (2, "fp32", 0.0, 1, 8, (0.25, 3, 2, 1)),
}


class EarliestCopies(Copier):
    """A CPU stand-in for CUDA's copy stream at its most eager: a copy ordered after a `ready`
    event reads its source as it was when that event was recorded, not when the copy was
    queued. Kernels queued on the training stream between the two (e.g. dividing the interval's
    gradient sum into its mean) are then missed, as on a GPU where the copy starts at once -- a
    race the CPU's synchronous copies hide. Watches the tensors `watched()` returns."""

    def __init__(self, device: torch.device, watched: Callable[[], list[torch.Tensor | None]]) -> None:
        super().__init__(device)
        self.watched = watched

    def ready(self) -> Any:
        return [(t.data_ptr(), t.numel() * t.element_size(), t.clone()) for t in self.watched() if t is not None]

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Any:
        for base, nbytes, snap in after or []:
            if base <= src.data_ptr() < base + nbytes:
                start = (src.data_ptr() - base) // src.element_size()
                src = snap.reshape(-1)[start : start + src.numel()].view(src.shape)
                break
        return super().to_host(dst, src, None)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 24)
        self.up = nn.Linear(24, 40)
        self.down = nn.Linear(40, 24)
        self.head = nn.Linear(24, VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.down(F.gelu(self.up(self.emb(ids))))
        return F.cross_entropy(self.head(h).float().view(-1, VOCAB), targets.view(-1))


SHAPES = {n: tuple(p.shape) for n, p in Net().named_parameters()}
DEVICE = torch.device("cpu")  # the training device: run() sets it to the engine's


def batch(step: int, micro: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro + 100_003 * rank)
    ids, tgt = torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g)
    return ids.to(DEVICE), tgt.to(DEVICE)


def config(stage: int, dtype: str, clip: float, accum: int, zf: tuple[float, int, int, int]) -> dict:
    topk, select, update, warm = zf
    zero: dict = {
        "stage": stage,
        "reduce_bucket_size": 2000,
        "sub_group_size": 700,  # several CPU tiles per shard
        "offload_optimizer": {"device": "cpu"},
        "zenflow": {
            "topk_ratio": topk,
            "select_strategy": "step" if select else "auto",
            "select_interval": select or "auto",
            "update_interval": update,
            "full_warm_up_rounds": warm,
        },
    }
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def reference(
    model: nn.Module,
    dtype: torch.dtype,
    clip: float,
    accum: int,
    steps: int,
    zf: tuple,
    ranges: dict[str, list[tuple[int, int]]],
    world: int,
    engine_masks: list[dict[str, torch.Tensor]] | None = None,
    engine_grads: list[dict[str, torch.Tensor]] | None = None,
) -> dict:
    """zerorun's ZenFlow rule, plainly: AdamW on masked elements of whole parameters. Columns of
    a parameter of 2+ dimensions: its last dimension; 1-D parameters always important. The
    important elements step every step (their own counter, started from the warm-up count), the
    others on the mean of their k summed gradients at k times the learning rate every
    update_interval steps and before a re-selection (the host counter); selection = top ceil(topk * C) squared column norms of the
    step's clipped gradient, chosen separately in each rank's part of the parameter (`ranges`:
    name -> the [lo, hi) of its flattened values each rank holds, from the flat layouts). The
    gradient is the mean over the `world` ranks' batches (losses: rank 0's batch).

    With `engine_masks` (the engine's important elements at each selection, name -> flat bool),
    the reference checks that the engine chose a top-k by its own scores -- up to near-ties:
    `violation` is the largest (k-th score - chosen score) / k-th score -- and continues with the
    engine's choice, so the update rule is compared exactly even where the two sides' gradients
    differ in the last bits (bf16 matmuls with other kernels on a GPU) and a near-tie flips.

    With `engine_grads` (the clipped, rank-averaged gradient the engine's optimizer step was
    given at each step, name -> tensor), the reference measures how far its own gradient is from
    it (`grad_err`: per parameter, max |difference| / max |reference's|) and then steps with the
    engine's: the update rule is compared on the very same inputs. Without that, one bf16 ulp of
    difference in the gradients (a GPU's matmul kernels for the engine's flat-buffer views vs the
    reference's own tensors) moves masters by more than 1e-3 of their scale at this learning
    rate (test_offload_zenflow.py::test_reference_is_sensitive_to_one_ulp)."""
    topk, interval, update, warm = zf
    master = model
    compute = copy.deepcopy(master).to(dtype) if dtype != torch.float32 else master
    names = [n for n, p in master.named_parameters()]
    ps = list(master.parameters())
    cs = list(compute.parameters())
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    acc = [torch.zeros_like(p) for p in ps]
    state: dict[str, Any] = {
        "slow": 0, "fast": 0, "count": 0, "zf": 0, "selections": 0, "mismatches": 0, "violation": 0.0,
        "unadopted": 0, "count_errors": 0, "grad_err": 0.0,
    }
    important: list[torch.Tensor] = []
    own_grads: list[dict[str, torch.Tensor]] = []  # the reference's own gradient of each step (clipped)

    def adamw(masks: list[torch.Tensor], grads: list[torch.Tensor], t: int, lr: float = LR) -> None:
        with torch.no_grad():
            for p, g, mm, vv, mask in zip(ps, grads, m, v, masks, strict=True):
                p[mask] = p[mask] * (1 - lr * WD)
                mm[mask] = B1 * mm[mask] + (1 - B1) * g[mask]
                vv[mask] = B2 * vv[mask] + (1 - B2) * g[mask] * g[mask]
                denom = vv[mask].sqrt() / math.sqrt(1 - B2**t) + EPS
                p[mask] = p[mask] - lr / (1 - B1**t) * mm[mask] / denom

    def select(grads: list[torch.Tensor]) -> list[torch.Tensor]:
        own = _select(grads)
        if engine_masks is None:
            return own
        adopted = engine_masks[state["selections"]]
        state["selections"] += 1
        out = []
        for name, g, mine in zip(names, grads, own, strict=True):
            theirs = adopted[name].to(g.device).view(g.shape) if name in adopted else mine
            state["mismatches"] += int(not torch.equal(theirs, mine))
            if g.dim() >= 2:
                state["unadopted"] += int(name not in adopted)  # then nothing of the engine's is checked
                cols, flat, chosen_flat = g.shape[-1], g.reshape(-1), theirs.reshape(-1)
                k = min(cols, max(1, math.ceil(topk * cols)))
                for lo, hi in ranges[name]:
                    col = torch.arange(lo, hi, device=g.device) % cols
                    score = torch.zeros(cols, device=g.device).index_add_(0, col, flat[lo:hi] ** 2)
                    kth = torch.topk(score, k).values[-1]
                    picked = col[chosen_flat[lo:hi]].unique()
                    # A part holding every column chose exactly k of them (fewer would pass the
                    # near-tie check above alone).
                    state["count_errors"] += int(hi - lo >= cols and picked.numel() != k)
                    if picked.numel() and float(kth) > 0:
                        worst = float((kth - score[picked].min()) / kth)
                        state["violation"] = max(state["violation"], worst)
            out.append(theirs)
        return out

    def _select(grads: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for name, g in zip(names, grads, strict=True):
            if g.dim() < 2:
                out.append(torch.ones_like(g, dtype=torch.bool))
                continue
            cols, flat = g.shape[-1], g.reshape(-1)
            mask = torch.zeros(flat.numel(), dtype=torch.bool, device=g.device)
            for lo, hi in ranges[name]:  # each rank chooses among the rows it holds
                col = torch.arange(lo, hi, device=g.device) % cols
                score = torch.zeros(cols, device=g.device).index_add_(0, col, flat[lo:hi] ** 2)
                chosen = torch.zeros(cols, dtype=torch.bool, device=g.device)
                chosen[torch.topk(score, min(cols, max(1, math.ceil(topk * cols)))).indices] = True
                mask[lo:hi] = chosen[col]
            out.append(mask.view(g.shape))
        return out

    def slow() -> None:
        if state["count"] == 0:
            return
        state["slow"] += 1
        k = state["count"]
        adamw([~s for s in important], [a / k for a in acc], state["slow"], lr=LR * k)
        for a in acc:
            a.zero_()
        state["count"] = 0

    losses = []
    for step in range(steps):
        grads = [torch.zeros_like(p, dtype=torch.float32) for p in cs]
        for micro in range(accum):
            for r in range(world):  # each rank's gradient in the compute dtype, summed in fp32
                loss = compute(*batch(step, micro, r))
                if r == 0:
                    losses.append(float(loss.detach()))
                (loss / accum).backward()
                for g, p in zip(grads, cs, strict=True):
                    if p.grad is not None:
                        g.add_(p.grad.float())
                        p.grad = None
        grads = [g / world for g in grads]
        if clip > 0:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            coef = torch.clamp(torch.tensor(clip, device=norm.device) / (norm + 1e-6), max=1.0)
            grads = [g * coef for g in grads]
        own_grads.append({n: g.detach().cpu().clone() for n, g in zip(names, grads, strict=True)})
        if engine_grads is not None:
            theirs = [engine_grads[step][n].to(g.device).view(g.shape) for n, g in zip(names, grads, strict=True)]
            for g, t in zip(grads, theirs, strict=True):
                if float(g.abs().max()) > 0:
                    state["grad_err"] = max(state["grad_err"], float((g - t).abs().max() / g.abs().max()))
            grads = theirs
        if step < warm:
            state["slow"] += 1
            adamw([torch.ones_like(g, dtype=torch.bool) for g in grads], grads, state["slow"])
        else:
            if not important:
                important[:] = select(grads)
                state["fast"] = state["slow"]
            elif interval and state["zf"] % interval == 0:
                slow()
                important[:] = select(grads)
            state["fast"] += 1
            adamw(important, grads, state["fast"])
            for a, g in zip(acc, grads, strict=True):
                a.add_(g)
            state["count"] += 1
            state["zf"] += 1
            if state["count"] >= update:
                slow()
        if compute is not master:
            with torch.no_grad():
                for c, p in zip(cs, ps, strict=True):
                    c.copy_(p)
    return {
        "losses": losses,
        "selection_violation": state["violation"],
        "selection_mismatches": state["mismatches"],
        "selection_unadopted": state["unadopted"],
        "selection_count_errors": state["count_errors"],
        "grad_err": state["grad_err"],
        "grads": own_grads,
        "master": {n: p.detach().cpu().clone() for n, p in zip(names, ps, strict=True)},
        "compute": {n: p.detach().float().cpu().clone() for n, p in compute.named_parameters()},
    }


def exact_losses(model: nn.Module, dtype: torch.dtype, clip: float, accum: int, steps: int, world: int) -> list[float]:
    """Plain AdamW on every element every step: what ZenFlow departs from."""
    master = model
    compute = copy.deepcopy(master).to(dtype) if dtype != torch.float32 else master
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for step in range(steps):
        for micro in range(accum):
            per_rank = [compute(*batch(step, micro, r)) for r in range(world)]
            losses.append(float(per_rank[0].detach()))
            (sum(per_rank) / (world * accum)).backward()
        if compute is not master:
            for p, c in zip(master.parameters(), compute.parameters(), strict=True):
                p.grad, c.grad = c.grad.float(), None
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if compute is not master:
            with torch.no_grad():
                for c, p in zip(compute.parameters(), master.parameters(), strict=True):
                    c.copy_(p)
    return losses


def _important_elements(engine: Any, placement: Any, rank: int) -> dict[str, list[int]]:
    """The placement's important elements now, as indices into each parameter's flattened
    values (this rank's shard; one-dimensional parameters left out: always important)."""
    out: dict[str, list[int]] = {}
    for i, layout in enumerate(engine.stage.state.layouts):
        idx = placement._idx[i]
        if idx is None:
            continue
        start, end = layout.shard_range(engine.stage.state.shard_index)
        idx = idx.cpu()
        for slot, lo, hi in layout.pieces_in_range(start, end):
            if len(slot.shape) < 2:
                continue
            off = slot.offset + lo - start
            inside = idx[(idx >= off) & (idx < off + hi - lo)]
            out.setdefault(slot.name, []).extend((inside - off + lo).tolist())
    return out


def _capture_grads(placement: Any) -> list[dict[int, torch.Tensor]]:
    """Record the gradient shard each optimizer step hands the placement (clipped, averaged over
    the ranks), per flat buffer: a device copy, no host sync (the copies' timing stays)."""
    steps: list[dict[int, torch.Tensor]] = []
    inner = placement.grad_for_step

    def grad_for_step(index: int, grad_shard: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        if index == 0:
            steps.append({})
        steps[-1][index] = grad_shard.detach().reshape(-1).float().clone()
        return inner(index, grad_shard, master)

    placement.grad_for_step = grad_for_step
    return steps


def _full_grads(engine: Any, steps: list[dict[int, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Every rank's recorded gradient shards, gathered and cut into named parameters (CPU)."""
    state = engine.stage.state
    on = engine.device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")  # (as full_masters)
    out: list[dict[str, torch.Tensor]] = []
    for shards in steps:
        named: dict[str, torch.Tensor] = {}
        for i, layout in enumerate(state.layouts):
            shard = shards[i].to(on)
            assert shard.numel() == layout.shard_numel, (shard.numel(), layout.shard_numel)
            full = torch.empty(layout.padded_numel, dtype=torch.float32, device=on)
            if layout.num_shards > 1:
                torch.distributed.all_gather_into_tensor(full, shard)
            else:
                full.copy_(shard)
            full = full.cpu()
            for slot in layout.slots:
                named[slot.name] = full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
        out.append(named)
    return out


def _mask(name: str, elements: list[int]) -> torch.Tensor:
    mask = torch.zeros(math.prod(SHAPES[name]), dtype=torch.bool)
    mask[torch.tensor(elements, dtype=torch.long)] = True
    return mask


def run(name: str) -> dict:
    stage, dtype, clip, accum, steps, zf = CASES[name]
    torch.manual_seed(7)
    model = Net()
    ref_model = copy.deepcopy(model)
    exact_model = copy.deepcopy(model)
    engine, _, _, _ = zerorun.initialize(model=model, config=config(stage, dtype, clip, accum, zf))
    global DEVICE
    DEVICE = engine.device
    placement = engine.stage.state.placement
    if name.endswith("early-copies") and engine.device.type == "cpu":
        # A CPU stand-in; on a GPU the real copy stream is the eager one (scripts/gpu_checks.sh).
        placement.copier = EarliestCopies(engine.device, lambda: list(placement._acc))
    rank, world = engine.comm.rank, engine.comm.world_size
    recorded = _capture_grads(placement)
    ranges: dict[str, list[tuple[int, int]]] = {}
    for layout in engine.stage.state.layouts:
        for r in range(layout.num_shards):
            for slot, lo, hi in layout.pieces_in_range(*layout.shard_range(r)):
                ranges.setdefault(slot.name, []).append((lo, hi))
    losses = []
    selections: list[dict[str, list[int]]] = []  # this rank's important elements at each selection
    for step in range(steps):
        for micro in range(accum):
            loss = engine(*batch(step, micro, rank))
            losses.append(loss.item())
            engine.backward(loss)
            engine.step()
        if placement.selections > len(selections):
            selections.append(_important_elements(engine, placement, rank))
    every: list = [None] * world
    torch.distributed.all_gather_object(every, selections)
    engine_masks = [
        {
            name: _mask(name, [e for r in range(world) for e in every[r][k].get(name, [])])
            # every rank's parameters: one may lie wholly in another rank's shard
            for name in sorted({n for r in range(world) for n in every[r][k]})
        }
        for k in range(len(selections))
    ]
    masters = _models.full_masters(engine)
    engine_grads = _full_grads(engine, recorded)
    if stage == 3:
        with zerorun.zero.GatheredParameters(list(model.parameters())):
            compute = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    else:
        compute = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    memory = engine.memory_summary()
    info = {
        "placement": type(placement).__name__,
        "zf_steps": placement.zf_steps,
        "cpu_updates": placement.cpu_updates,
        "selections": placement.selections,
        "steps": placement.steps,
        "n_buffers": len(engine.stage.state.masters),
        "important": [int(i.numel()) if i is not None else 0 for i in placement._idx],
        "shard": [int(m.numel()) for m in engine.stage.state.masters],
        "memory": memory,
    }
    engine.destroy()
    if rank != 0:
        return info
    # The reference runs on the training device too (the same matmul kernels as the engine).
    ref = reference(
        ref_model.to(DEVICE), DTYPES[dtype], clip, accum, steps, zf, ranges, world, engine_masks, engine_grads
    )
    exact = exact_losses(exact_model.to(DEVICE), DTYPES[dtype], clip, accum, steps, world)

    def err(a: torch.Tensor, b: torch.Tensor) -> list[float]:
        return [float((a - b).abs().max()), float(b.abs().max())]

    return {
        **info,
        "losses": losses,
        "ref_losses": ref["losses"],
        "exact_losses": exact,
        "master_err": {n: err(masters[n], ref["master"][n]) for n in ref["master"]},
        "compute_err": {n: err(compute[n], ref["compute"][n]) for n in ref["compute"]},
        "selection_violation": ref["selection_violation"],
        "selection_mismatches": ref["selection_mismatches"],
        "selection_unadopted": ref["selection_unadopted"],
        "selection_count_errors": ref["selection_count_errors"],
        "grad_err": ref["grad_err"],
        "device": DEVICE.type,
    }


# Checkpoint of an open update interval: (stage, steps, save after, zenflow) -- fp32, update
# every 3 steps, re-selection every 4: saved after 6 steps (one warm-up step + 5 selective ones)
# the interval holds one step's gradient sum; after the resume come an update and a re-selection.
RESUME: dict[str, tuple[int, int, int, tuple[float, int, int, int]]] = {
    "resume-z2": (2, 10, 6, (0.25, 4, 3, 1)),
    "resume-z3": (3, 10, 6, (0.25, 4, 3, 1)),
}


def resume(name: str, ckpt: Path) -> dict:
    """The same run three ways: uninterrupted; stopped after `save_at` steps with a checkpoint;
    resumed from it into a model built with other weights. The resumed steps must be the
    uninterrupted ones."""
    stage, steps, save_at, zf = RESUME[name]
    cfg = config(stage, "fp32", 0.0, 1, zf)
    torch.manual_seed(7)
    model = Net()

    def train(engine: object, first: int, last: int) -> list[float]:
        rank = engine.comm.rank  # type: ignore[attr-defined]
        out = []
        for step in range(first, last):
            loss = engine(*batch(step, 0, rank))  # type: ignore[operator]
            out.append(loss.item())
            engine.backward(loss)  # type: ignore[attr-defined]
            engine.step()  # type: ignore[attr-defined]
        return out

    engine, _, _, _ = zerorun.initialize(model=copy.deepcopy(model), config=cfg)
    whole = train(engine, 0, steps)
    masters_whole = _models.full_masters(engine)
    engine.destroy()

    engine, _, _, _ = zerorun.initialize(model=copy.deepcopy(model), config=cfg)
    train(engine, 0, save_at)
    p = engine.stage.state.placement
    at_save = {"count": p._count, "zf_steps": p.zf_steps, "important": sum(int(i.numel()) for i in p._idx if i is not None)}
    engine.save_checkpoint(str(ckpt), tag="mid")
    engine.destroy()

    torch.manual_seed(99)  # other weights: everything must come from the checkpoint
    engine, _, _, _ = zerorun.initialize(model=Net(), config=cfg)
    engine.load_checkpoint(str(ckpt), tag="mid")
    p = engine.stage.state.placement
    loaded = {"count": p._count, "zf_steps": p.zf_steps, "important": sum(int(i.numel()) for i in p._idx if i is not None)}
    rest = train(engine, save_at, steps)
    after = {"selections": p.selections, "cpu_updates": p.cpu_updates, "zf_steps": p.zf_steps}
    masters_resumed = _models.full_masters(engine)
    engine.destroy()
    return {
        "whole": whole,
        "resumed": rest,
        "at_save": at_save,
        "loaded": loaded,
        "after": after,
        "master_err": max(float((masters_whole[n] - masters_resumed[n]).abs().max()) for n in masters_whole),
    }


def main() -> None:
    out = Path(sys.argv[1])
    torch.use_deterministic_algorithms(True)
    results = {name: run(name) for name in CASES}
    results.update({name: resume(name, out.parent / f"ckpt-{name}") for name in RESUME})
    if torch.distributed.get_rank() == 0:
        out.write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
