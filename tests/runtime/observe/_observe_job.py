"""A tiny token model trained through the real launcher with the reporting keys on.

Prints, on rank 0, one `TRUTH {json}` line per optimizer step with what the script itself
computed (mean micro-batch loss, engine.get_global_grad_norm(), lr, global samples), for the
test to compare with what the reports say.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

import zerorun
import zerorun.checkpointing as checkpointing


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 50))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # checkpointed as the config's activation_checkpointing says (profile: timed and reported)
        return checkpointing.checkpoint(self.body, self.emb(input_ids))


def main() -> None:
    steps = int(sys.argv[1])
    torch.manual_seed(0)
    model = TokenModel()
    engine, _, _, _ = zerorun.initialize(model=model)
    rank = engine.global_rank
    gen = torch.Generator().manual_seed(100 + rank)
    accum = engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    for _ in range(steps):
        losses = []
        for _ in range(accum):
            ids = torch.randint(0, 50, (micro, 12), generator=gen).to(engine.device)
            logits = engine(ids)
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        if rank == 0:
            truth = {
                "step": engine.global_steps,
                "loss": sum(losses) / len(losses),
                "grad_norm": engine.get_global_grad_norm(),
                "lr": engine.get_lr()[0],
                "samples": engine.global_samples,
            }
            print("TRUTH " + json.dumps(truth), flush=True)
    engine.destroy()
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
