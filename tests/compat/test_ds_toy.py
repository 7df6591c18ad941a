"""The article's section 3.1 ToyModel script, written for DeepSpeed, unchanged under
`zerorun --deepspeed-compat --num_gpus 2` (real ranks, gloo): it trains exactly like plain
PyTorch on the same global batches, and leaves DeepSpeed's checkpoint layout."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from torch.utils.data.distributed import DistributedSampler

from ._run import ROOT, launch

CONFIG = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 2,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5000},
}


def _toy_module():
    """examples/ds_toy.py's model and data, without running its `import deepspeed`."""
    source = (ROOT / "examples" / "ds_toy.py").read_text().replace("import deepspeed\n", "")
    spec = importlib.util.spec_from_loader("ds_toy_reference", loader=None)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    exec(compile(source, "examples/ds_toy.py", "exec"), module.__dict__)
    return module


def _reference(epochs: int, world: int, micro: int, accum: int) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """Plain PyTorch: every optimizer step averages the loss over the micro-batches that all
    ranks together saw in that window (what data parallelism computes)."""
    toy = _toy_module()
    torch.manual_seed(0)
    model = toy.ToyModel(64, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    criterion = torch.nn.CrossEntropyLoss()
    data = toy.make_data(256, 64, 0)
    losses: list[list[float]] = [[] for _ in range(world)]
    for epoch in range(epochs):
        batches = []
        for rank in range(world):
            sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            idx = list(sampler)
            batches.append([idx[i : i + micro] for i in range(0, len(idx), micro)])
        for start in range(0, len(batches[0]), accum):
            optimizer.zero_grad()
            for m in range(start, start + accum):
                for rank in range(world):
                    x, y = data[batches[rank][m]]
                    loss = criterion(model(x), y)
                    (loss / (accum * world)).backward()
                    losses[rank].append(loss.item())
            optimizer.step()
    return model.state_dict(), losses


def test_toy_script_unchanged_on_two_ranks(tmp_path: Path) -> None:
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(CONFIG))
    out = tmp_path / "out"
    proc = launch(
        ["--num_gpus", "2", "--device", "cpu", "examples/ds_toy.py", "--deepspeed_config", str(cfg), "--out", str(out)],
        timeout=240,
    )
    assert "epoch 1: last loss" in proc.stdout
    state, losses = _reference(epochs=2, world=2, micro=16, accum=2)
    for rank in (0, 1):
        got = json.loads((out / f"losses_rank{rank}.json").read_text())
        assert got["local_rank_arg"] == rank and got["world"] == 2  # --local_rank=N was passed
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses[rank]), rtol=1e-5, atol=1e-5)
    saved = torch.load(out / "model.pt", map_location="cpu")
    assert saved.keys() == state.keys()
    for name, value in state.items():
        torch.testing.assert_close(saved[name], value, rtol=1e-5, atol=1e-5, msg=name)
    ckpt = out / "checkpoint"
    assert (ckpt / "latest").read_text().strip() == "global_step8"  # 2 epochs x 8 micro-batches / 2
    assert (ckpt / "global_step8").is_dir()
    # DeepSpeed's after-training helpers read it (what zero_to_fp32.py users call).
    from safetensors.torch import load_file

    from zerorun.compat.deepspeed.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    fp32 = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "hf", safe_serialization=True)
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    loaded = load_state_dict_from_zero_checkpoint(_toy_module().ToyModel(64, 2), ckpt).state_dict()
    for name, value in state.items():
        for got in (fp32[name], exported[name], loaded[name]):
            torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-5, msg=name)
