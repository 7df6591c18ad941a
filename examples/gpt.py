"""Train a GPT-style model with zerorun: the README's main job.

    zerorun --num_gpus 2 examples/gpt.py --config templates/zero2.yaml

The model is examples/gpt_model.py (sizes tiny .. 7B); the data is synthetic and learnable
(repeated motifs; no download), generated on each rank's device. Defaults are CPU-friendly:
the "tiny" size for 30 steps finishes in seconds on CPU ranks. On GPUs try --size 125M or
--size 1.3B. The optimizer, ZeRO stage, precision and batch sizes come from the config.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

import torch

import zerorun

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt_model import GPT, SyntheticTokens, count_parameters, get_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=None, help="config file (default: the one given to zerorun)")
    parser.add_argument("--size", default="tiny", help="model size: tiny, 125M, 350M, 1.3B, 2.7B, 7B")
    parser.add_argument(
        "--seq_len", "--seq-len", type=int, default=None, help="sequence length (default: the size's)"
    )
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate: AdamW + linear warmup + cosine decay from the command line instead of "
        "the config's optimizer/scheduler (default: the config's; 1e-3 if it has none)",
    )
    parser.add_argument("--warmup", type=int, default=5, help="warmup steps of --lr's schedule")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--log_every", "--log-every", type=int, default=5)
    args = parser.parse_args()

    overrides = {"seq_len": args.seq_len} if args.seq_len else {}
    cfg = get_config(args.size, **overrides)
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = GPT(cfg)

    own = args.lr is not None or not _config_has_optimizer(args.config)
    peak = args.lr if args.lr is not None else 1e-3

    def adamw(params):  # noqa: ANN001, ANN202
        return torch.optim.AdamW(params, lr=peak, betas=(0.9, 0.95), weight_decay=0.1)

    def warmup_cosine(optimizer):  # noqa: ANN001, ANN202
        def factor(step: int) -> float:
            if step < args.warmup:
                return (step + 1) / args.warmup
            done = (step - args.warmup) / max(1, args.steps - args.warmup)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    with warnings.catch_warnings():
        # A script's own optimizer replacing the config's is the point of --lr here.
        warnings.filterwarnings("ignore", message=".*the script's optimizer is used")
        engine, _, _, _ = zerorun.initialize(
            model=model,
            config=args.config,
            optimizer=adamw if own else None,
            lr_scheduler=warmup_cosine if own else None,
        )
    rank, world = engine.global_rank, engine.world_size
    micro = engine.train_micro_batch_size_per_gpu()
    data = SyntheticTokens(cfg, micro, engine.device, seed=args.seed, rank=rank)
    if rank == 0:
        print(
            f"GPT {args.size}: {count_parameters(cfg) / 1e6:.2f}M parameters, ZeRO stage {engine.zero_optimization_stage()}, "
            f"{world} rank(s) on {engine.device.type}, micro batch {micro} x accumulation "
            f"{engine.gradient_accumulation_steps()} x {world} = {engine.train_batch_size()} sequences/step",
            flush=True,
        )
    tokens_per_step = engine.train_batch_size() * cfg.seq_len
    micro_step = 0
    start = time.perf_counter()
    first_loss = last_loss = None
    while engine.global_steps < args.steps:
        inputs, targets = data.batch(micro_step)
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        micro_step += 1
        if micro_step % engine.gradient_accumulation_steps() == 0:
            step = engine.global_steps
            if step == 1 or step % args.log_every == 0 or step == args.steps:
                value = loss.item()  # host sync, only when logging
                first_loss = value if first_loss is None else first_loss
                last_loss = value
                if rank == 0:
                    elapsed = time.perf_counter() - start
                    print(
                        f"step {step:4d}  loss {value:.4f}  lr {engine.get_lr()[0]:.2e}  "
                        f"grad norm {engine.get_global_grad_norm():.3f}  "
                        f"{tokens_per_step * step / elapsed:,.0f} tokens/s",
                        flush=True,
                    )
    if rank == 0:
        total = sum(v for k, v in next(iter(engine.memory_summary().values())).items() if k == "total")
        print(
            f"done: {engine.global_steps} steps, loss {first_loss:.4f} -> {last_loss:.4f}, "
            f"skipped {engine.skipped_steps}, model states {total / 2**20:.1f} MiB per rank",
            flush=True,
        )


def _config_has_optimizer(path: str | None) -> bool:
    """Whether the job's config builds the optimizer (then the script must not pass one)."""
    import json
    import os

    from zerorun.config import load_config

    if path is None:
        text = os.environ.get("ZERORUN_CONFIG_JSON")
        if text:
            return bool(json.loads(text).get("optimizer"))
        path = os.environ.get("ZERORUN_CONFIG")
        if path is None:
            return False
    return load_config(path).config.optimizer is not None


if __name__ == "__main__":
    main()
