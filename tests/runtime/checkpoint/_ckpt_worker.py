"""One rank of a checkpoint test job (started by test_engine_checkpoint.py with torchrun's
environment). Trains a small model through zerorun.initialize, loads/saves checkpoints as the
spec (argv[1], JSON) says, and rank 0 writes what it saw to spec["out"] (JSON)."""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

import zerorun
from zerorun.errors import CheckpointError

V, D, H = 37, 24, 29
GLOBAL_BATCH = 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.l1 = nn.Linear(D, H)
        self.frozen = nn.Linear(H, H)
        self.frozen.requires_grad_(False)
        self.l2 = nn.Linear(H, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("temperature", torch.tensor([0.9]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(self.emb(x).mean(1)))
        h = self.l2(torch.tanh(self.frozen(h)))
        return self.head(h) / self.temperature


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(V, (GLOBAL_BATCH, 5), generator=g)
    y = torch.randint(V, (GLOBAL_BATCH,), generator=g)
    n = GLOBAL_BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def config(stage: int, world: int, precision: str, offload: dict | None = None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 4}},
        "gradient_clipping": 1.0,
        # small buckets: several flat buffers, parameters cut by shard boundaries
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 700, "allgather_bucket_size": 700},
        "steps_per_print": 1000,
    }
    if stage == 3:
        # partition every parameter (DeepSpeed's default threshold would keep this tiny model
        # replicated) and prefetch
        cfg["zero_optimization"].update(
            stage3_param_persistence_threshold=0,
            stage3_prefetch_bucket_size=500,
            stage3_gather_16bit_weights_on_model_save=True,
        )
    if offload is not None:
        cfg["zero_optimization"]["offload_optimizer"] = offload
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        # a scale that overflows at first and grows back every 2 steps: the scaler's whole state
        # (scale, hysteresis, iteration of the last overflow) decides the next steps
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 2, "hysteresis": 2}
    return cfg


def _state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _optim_sum(engine) -> float:
    total = 0.0
    for s in engine.optimizer.state.values():
        if "exp_avg" in s:
            total += float(s["exp_avg"].double().sum())
    return total


def main() -> int:
    spec = json.loads(sys.argv[1])
    torch.manual_seed(0)
    model = Net()
    engine, *_ = zerorun.initialize(model=model, config=config(spec["stage"], int(spec["world"]), spec.get("precision", "fp32"), spec.get("offload")))
    rank, world = engine.global_rank, engine.world_size
    report: dict = {"losses": {}, "rank": rank, "world": world}
    if spec.get("load") is not None:
        path, client = engine.load_checkpoint(spec["ckpt"], tag=spec["load"] or None, **spec.get("load_flags", {}))
        report.update(loaded=path, client_state=client, steps_after_load=engine.global_steps,
                      samples_after_load=engine.global_samples, lr_after_load=engine.get_lr(),
                      scale_after_load=engine.get_loss_scale(), skipped_after_load=engine.skipped_steps,
                      rng_after_load=torch.rand(3).tolist())
    try:
        while engine.global_steps < spec["steps_to"]:
            step = engine.global_steps
            x, y = batch(step, rank, world)
            loss = nn.functional.cross_entropy(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
            g = loss.detach().clone()
            dist.all_reduce(g)
            report["losses"][str(step + 1)] = g.item() / world
            report.setdefault("scales", {})[str(step + 1)] = (engine.get_loss_scale(), engine.skipped_steps)
            if str(engine.global_steps) in spec.get("state_dict_at", {}) and rank == 0:
                torch.save(_state_dict(model), spec["state_dict_at"][str(engine.global_steps)])
            if engine.global_steps in spec.get("save_at", []):
                engine.save_checkpoint(spec["ckpt"], client_state={"step": engine.global_steps, "note": "resume me"})
                report[f"rng_after_save{engine.global_steps}"] = torch.rand(3).tolist()
                report[f"scale_at{engine.global_steps}"] = engine.get_loss_scale()
                report[f"lr_at{engine.global_steps}"] = engine.get_lr()
                report[f"skipped_at{engine.global_steps}"] = engine.skipped_steps
                if rank == 0 and spec.get("reference"):
                    torch.save(_state_dict(model), spec["reference"])
                if spec.get("save16"):
                    report["save16"] = engine.save_16bit_model(spec["save16"], "model.safetensors")
    except CheckpointError as err:
        report["save_error"] = str(err)
    report.update(scale_final=engine.get_loss_scale(), skipped_final=engine.skipped_steps)
    # after training: further loads with DeepSpeed's flags, reporting what each restored
    if spec.get("save16_final"):
        dir_, name = spec["save16_final"]
        report["save16_final"] = engine.save_16bit_model(dir_, name)
        if rank == 0:
            torch.save(_state_dict(model), f"{dir_}/reference.pt")
    for i, extra in enumerate(spec.get("extra_saves", [])):
        try:
            engine.save_checkpoint(extra["dir"], **extra["kwargs"])
        except CheckpointError as err:
            report[f"extra_save{i}"] = str(err)
    for i, extra in enumerate(spec.get("extra_loads", [])):
        exp_avg_before = _optim_sum(engine)
        try:
            engine.load_checkpoint(extra.get("dir", spec["ckpt"]), tag=extra["tag"], **extra["flags"])
        except CheckpointError as err:
            report[f"extra{i}"] = {"error": str(err)}
            continue
        report[f"extra{i}"] = {
            "steps": engine.global_steps,
            "lr": engine.get_lr(),
            "params": {n: p.detach().double().sum().item() for n, p in model.named_parameters()},
            "exp_avg_changed": _optim_sum(engine) != exp_avg_before,
        }
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump(report, f)
    if "save_error" not in report:
        # a clean shutdown: gloo can abort ("terminate called ...") when a process exits while a
        # peer's connection is still open
        dist.barrier()
        dist.destroy_process_group()
    return 3 if "save_error" in report else 0


if __name__ == "__main__":
    try:
        status = main()
    except Exception:
        traceback.print_exc()
        status = 1
    # With a peer dead, gloo's C++ teardown can abort the interpreter (SIGABRT) after main()
    # returned; the status is what the tests check, so skip that teardown (as zerorun's shim does).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
