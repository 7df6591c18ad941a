"""The article's section 3.1 training loop -- ToyModel, AdamW, cross-entropy -- on zerorun.

    zerorun --num_gpus 2 examples/toy.py --config templates/zero2.yaml

The DeepSpeed version differs in two lines: `import deepspeed` and `deepspeed.initialize`.
The optimizer, the ZeRO stage, precision and batch sizes come from the config; the defaults
here are small enough for CPU ranks (the article used --hidden 1024 --layers 12 --samples 1000).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import zerorun


class ToyModel(nn.Module):
    """Stand-in for BERT layers: residual MLP blocks and a 10-way classifier."""

    def __init__(self, hidden_size: int = 1024, num_layers: int = 12) -> None:
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) + x  # residual
        return self.classifier(x)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=None, help="config file (default: the one given to zerorun)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)  # same initial model on every rank
    model = ToyModel(args.hidden, args.layers)
    criterion = nn.CrossEntropyLoss()
    x = torch.randn(args.samples, args.hidden)
    y = torch.randint(0, 10, (args.samples,))
    dataset = TensorDataset(x, y)

    # The article passes its own AdamW; a config `optimizer:` section works as well.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model_engine, optimizer, dataloader, _ = zerorun.initialize(
        model=model,
        optimizer=optimizer,
        model_parameters=model.parameters(),
        training_data=dataset,
        config=args.config,
    )

    rank = model_engine.global_rank
    for epoch in range(args.epochs):
        dataloader.sampler.set_epoch(epoch)
        for inputs, labels in dataloader:
            inputs, labels = inputs.to(model_engine.device), labels.to(model_engine.device)
            outputs = model_engine(inputs)  # forward: the engine replaces the model
            loss = criterion(outputs.float(), labels)
            model_engine.backward(loss)  # replaces loss.backward()
            model_engine.step()  # replaces optimizer.step()
        if rank == 0:
            print(
                f"epoch {epoch}: loss {loss.item():.4f} steps {model_engine.global_steps} "
                f"grad norm {model_engine.get_global_grad_norm():.4f}",
                flush=True,
            )
    if rank == 0:
        mem = model_engine.memory_summary()
        for device, parts in mem.items():
            shown = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in parts.items() if v)
            print(f"rank 0 {device}: {shown}", flush=True)


if __name__ == "__main__":
    main()
