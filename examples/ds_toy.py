"""The article's section 3.1 ToyModel script, written against DeepSpeed's API.

Runs unchanged under either launcher:

    deepspeed --num_gpus 2 examples/ds_toy.py --deepspeed_config ds_config.json
    zerorun --deepspeed-compat --num_gpus 2 examples/ds_toy.py --deepspeed_config ds_config.json

Nothing here mentions zerorun: under `--deepspeed-compat`, `import deepspeed` is zerorun's
compatibility layer. `--out DIR` writes each step's loss (rank 0) and, at the end, a DeepSpeed
checkpoint and the 16-bit model there. The article used --hidden 1024 --layers 12
--samples 1000; the defaults are small enough for CPU ranks.
"""

import argparse
import json
import os

import deepspeed
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset


class ToyModel(nn.Module):
    """Stand-in for BERT layers: residual MLP blocks and a 10-way classifier."""

    def __init__(self, hidden_size=1024, num_layers=12):
        super().__init__()
        self.layers = nn.ModuleList(
            [
                nn.Sequential(
                    nn.Linear(hidden_size, hidden_size * 4),
                    nn.GELU(),
                    nn.Linear(hidden_size * 4, hidden_size),
                )
                for _ in range(num_layers)
            ]
        )
        self.classifier = nn.Linear(hidden_size, 10)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) + x  # residual
        return self.classifier(x)


def make_data(samples, hidden, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, hidden, generator=g)
    y = torch.randint(0, 10, (samples,), generator=g)
    return TensorDataset(x, y)


def main():
    parser = argparse.ArgumentParser(description="ToyModel on DeepSpeed (article section 3.1)")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the launcher")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="losses, checkpoint and 16-bit model go here")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = ToyModel(args.hidden, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    criterion = nn.CrossEntropyLoss()
    dataset = make_data(args.samples, args.hidden, args.seed)

    # The batch size and ZeRO stage come from the config (--deepspeed_config).
    model_engine, optimizer, dataloader, _ = deepspeed.initialize(
        args=args,
        model=model,
        optimizer=optimizer,
        model_parameters=model.parameters(),
        training_data=dataset,
    )

    losses = []
    for epoch in range(args.epochs):
        dataloader.sampler.set_epoch(epoch)
        for x, labels in dataloader:
            x, labels = x.to(model_engine.device), labels.to(model_engine.device)
            outputs = model_engine(x)  # forward: model_engine replaces model
            loss = criterion(outputs.float(), labels)
            model_engine.backward(loss)  # replaces loss.backward()
            model_engine.step()  # replaces optimizer.step()
            losses.append(loss.item())
        if model_engine.global_rank == 0:
            print(f"epoch {epoch}: last loss {losses[-1]:.4f}, steps {model_engine.global_steps}")

    if args.out:
        model_engine.save_checkpoint(os.path.join(args.out, "checkpoint"))
        model_engine.save_16bit_model(args.out, "model.pt")
        rank = deepspeed.comm.get_rank()
        with open(os.path.join(args.out, f"losses_rank{rank}.json"), "w") as fh:
            json.dump({"losses": losses, "local_rank_arg": args.local_rank, "world": deepspeed.comm.get_world_size()}, fh)


if __name__ == "__main__":
    main()
