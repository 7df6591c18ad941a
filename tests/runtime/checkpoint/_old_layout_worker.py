"""One rank of the pre-alignment checkpoint test (test_old_layout.py).

Before 1558da7 ("every parameter starts 16-byte aligned in its flat buffer") parameters were
packed back to back in the flat buffers; since then odd-sized parameters leave gaps. The
checkpoint format stores fragments by parameter name and element range, so a checkpoint written
with the old packing must load into the new one. The fixture under fixtures/stage3_pre_align was
written by this script run against the commit before the change (e1e5b60):

    git worktree add /tmp/old e1e5b60
    PYTHONPATH=/tmp/old torchrun --nproc_per_node 2 tests/runtime/checkpoint/_old_layout_worker.py \\
        make tests/runtime/checkpoint/fixtures/stage3_pre_align
    git worktree remove /tmp/old

``make``: stage 3, bf16, 2 ranks, a model whose parameter sizes are odd (5, 7, 13: with 16-byte
slots every one after the first moves); train STEPS_BEFORE steps, save, record the fp32 masters,
train STEPS_AFTER more steps and record their losses and the final masters (expected.json).
``check DIR OUT``: build the same model with today's code, load DIR, write what it sees (masters
after the load, the losses and masters after the same further steps) to OUT (rank 0).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zerorun

STEPS_BEFORE, STEPS_AFTER, MICRO, VOCAB = 2, 3, 3, 13


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.norm = nn.LayerNorm(7)
        self.fc2 = nn.Linear(7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.norm(self.fc1(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 5)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(5, VOCAB)

    def forward(self, ids: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return nn.functional.cross_entropy(self.head(x).float().view(-1, VOCAB), tgt.view(-1))


def config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-2, "weight_decay": 0.01}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (MICRO, 6), generator=g)
    return ids, torch.roll(ids, 1, dims=1)


def masters(engine) -> dict[str, list[float]]:  # noqa: ANN001
    """Every parameter's fp32 master, whole (all-gathered from the flat buffers' shards)."""
    st = engine.stage.state
    out = {}
    for layout, master in zip(st.layouts, st.masters, strict=True):
        full = torch.empty(layout.padded_numel, dtype=torch.float32)
        if layout.num_shards > 1:
            dist.all_gather_into_tensor(full, master.detach().float().contiguous())
        else:
            full.copy_(master.detach().float())
        for slot in layout.slots:
            out[slot.name] = full[slot.offset : slot.offset + slot.numel].tolist()
    return out


def train(engine, first: int, n: int, rank: int) -> list[float]:  # noqa: ANN001
    losses = []
    for step in range(first, first + n):
        ids, tgt = batch(step, rank)
        loss = engine(ids, tgt)
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().reshape(1)
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses


def main() -> None:
    mode, target = sys.argv[1], Path(sys.argv[2])
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    engine, *_ = zerorun.initialize(model=Net(), config=config())
    rank = dist.get_rank()
    if mode == "make":
        train(engine, 0, STEPS_BEFORE, rank)
        engine.save_checkpoint(str(target), tag="pre_align")
        saved = masters(engine)
        after = train(engine, STEPS_BEFORE, STEPS_AFTER, rank)
        offsets = {s.name: s.offset for layout in engine.stage.state.layouts for s in layout.slots}
        record = {"masters_at_save": saved, "losses_after": after, "masters_after": masters(engine)}
        record["slot_offsets"] = offsets
        if rank == 0:
            (target / "expected.json").write_text(json.dumps(record))
    else:
        engine.load_checkpoint(str(target), tag="pre_align")
        loaded = masters(engine)
        after = train(engine, STEPS_BEFORE, STEPS_AFTER, rank)
        offsets = {s.name: s.offset for layout in engine.stage.state.layouts for s in layout.slots}
        record = {"masters_at_load": loaded, "losses_after": after, "masters_after": masters(engine)}
        record["slot_offsets"] = offsets
        record["global_steps"] = engine.global_steps
        if rank == 0:
            Path(sys.argv[3]).write_text(json.dumps(record))
    engine.destroy()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("ZERORUN_DEVICE", "cpu")
    main()
