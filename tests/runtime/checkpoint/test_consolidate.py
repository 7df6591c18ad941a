"""Consolidation: the output equals the reference state_dict; memory stays bounded (RSS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from zerorun.cli.consolidate_cmd import app
from zerorun.runtime.checkpoint.format import META_FILE, WEIGHT
from zerorun.runtime.checkpoint.store import write_rank_shard

from ._layout import meta_for, rank_fragments


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(19, 6)
        self.body = torch.nn.Linear(6, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.head = torch.nn.Linear(6, 19, bias=False)
        self.head.weight = self.emb.weight  # tied


def _save_model(model: torch.nn.Module, ckpt: Path, world_size: int = 2) -> None:
    """Write `model` as a world-`world_size` stage-2 checkpoint with tag global_step3."""
    params = dict(model.named_parameters())  # tied: first name only
    all_names = dict(model.named_parameters(remove_duplicate=False))
    tied = {n: next(c for c, p in params.items() if p is t) for n, t in all_names.items() if n not in params}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    state = {WEIGHT: {n: p.detach().clone() for n, p in params.items()}}
    tag = ckpt / "global_step3"
    tag.mkdir(parents=True)
    for r in range(world_size):
        frags = rank_fragments(state, world_size=world_size, rank=r, stage=2, bucket_numel=64, buffers=buffers)
        write_rank_shard(tag, r, world_size, frags)
    meta = meta_for(state, world_size=world_size, stage=2, buffers=buffers, tied=tied)
    (tag / META_FILE).write_text(meta.to_json())
    (ckpt / "latest").write_text("global_step3")


def _reference() -> Tiny:
    torch.manual_seed(0)
    m = Tiny()
    with torch.no_grad():
        m.norm.running_mean.normal_()
        m.norm.num_batches_tracked.fill_(11)
    return m


def test_consolidated_safetensors_equals_state_dict(tmp_path):
    model = _reference()
    _save_model(model, tmp_path / "ckpt")
    res = CliRunner().invoke(app, [str(tmp_path / "ckpt"), str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "head.weight -> emb.weight" in res.output
    sd = load_file(str(tmp_path / "out" / "model.safetensors"))
    ref = model.state_dict()
    assert set(ref) - set(sd) == {"head.weight"}  # tied: written once, as HF expects
    for k, v in sd.items():
        assert v.dtype == ref[k].dtype and torch.equal(v, ref[k]), k
    # plain PyTorch: load and re-tie
    fresh = Tiny()
    missing, unexpected = fresh.load_state_dict(sd, strict=False)
    assert missing == ["head.weight"] and not unexpected
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, ref[k])


def test_in_memory_state_dict_and_plain_model_load(tmp_path):
    """DeepSpeed's get_fp32_state_dict_from_zero_checkpoint / load_state_dict_from_zero_checkpoint."""
    from zerorun.runtime.checkpoint import get_fp32_state_dict, load_state_dict_from_checkpoint

    model = _reference()
    _save_model(model, tmp_path / "ckpt")
    sd = get_fp32_state_dict(tmp_path / "ckpt")
    ref = model.state_dict()
    assert set(sd) == set(ref) and sd["head.weight"] is sd["emb.weight"]
    for k in ref:
        assert torch.equal(sd[k], ref[k]), k
    fresh = load_state_dict_from_checkpoint(Tiny(), tmp_path / "ckpt" / "global_step3")  # strict
    assert fresh.head.weight is fresh.emb.weight  # still tied
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_consolidated_torch_shards_and_bf16(tmp_path):
    model = _reference()
    _save_model(model, tmp_path / "ckpt", world_size=3)
    out = tmp_path / "out"
    res = CliRunner().invoke(
        app,
        [str(tmp_path / "ckpt"), str(out), "--format", "torch", "--dtype", "bf16", "--max_shard_size", "300B", "--tag", "global_step3"],
    )
    assert res.exit_code == 0, res.output
    # a second export into the same directory: refused (old shards would mislead loaders) ...
    again = CliRunner().invoke(app, [str(tmp_path / "ckpt"), str(out), "--dtype", "auto"])
    assert again.exit_code == 1 and "--overwrite" in " ".join(again.output.split())
    # ... or replaces them; `auto` keeps the trained dtype (fp32 here)
    again = CliRunner().invoke(app, [str(tmp_path / "ckpt"), str(out), "--dtype", "auto", "--overwrite"])
    assert again.exit_code == 0, again.output
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert load_file(str(out / "model.safetensors"))["body.weight"].dtype == torch.float32
    out = tmp_path / "out2"
    res = CliRunner().invoke(
        app,
        [str(tmp_path / "ckpt"), str(out), "--format", "torch", "--dtype", "bf16", "--max_shard_size", "300B", "--tag", "global_step3"],
    )
    assert "wrote pytorch_model-00001-of-" in res.output  # progress, one line per file
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(f.startswith("pytorch_model-") and f.endswith(f"-of-{len(files):05d}.bin") for f in files)
    merged: dict[str, torch.Tensor] = {}
    for f in files:
        merged.update(torch.load(out / f, weights_only=True))
    ref = model.state_dict()
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in merged.values())
    assert index["metadata"]["zerorun_tied"] == {"head.weight": "emb.weight"}
    for k, v in merged.items():
        want = ref[k].bfloat16() if ref[k].is_floating_point() else ref[k]
        assert v.dtype == want.dtype and torch.equal(v, want), k


def test_cli_user_errors_are_messages(tmp_path):
    def run(*args: str) -> str:
        res = CliRunner().invoke(app, [str(tmp_path), str(tmp_path / "o"), *args])
        assert res.exit_code == 1 and res.exception is None or isinstance(res.exception, SystemExit)
        return " ".join(res.output.split())  # rich wraps long lines

    assert "has no 'latest' file" in run()
    assert "no checkpoint 'global_step9'" in run("--tag", "global_step9")
    assert "--dtype 'int8'" in run("--dtype", "int8")
    assert "--max_shard_size '5 parsecs'" in run("--max_shard_size", "5 parsecs")
    (tmp_path / "global_step1").mkdir()
    (tmp_path / "latest").write_text("global_step1")
    assert "is not a complete zerorun checkpoint" in run()


_RSS_SCRIPT = textwrap.dedent(
    """
    import sys, psutil, torch
    from zerorun.runtime.checkpoint.consolidate import consolidate
    torch.ones(1000).sum()
    base = psutil.Process().memory_info().rss
    consolidate(sys.argv[1], sys.argv[2], fmt=sys.argv[3], max_shard_size=int(sys.argv[4]))
    # VmHWM: this process image's peak RSS (ru_maxrss would include the parent's peak at fork)
    hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    print(int(hwm.split()[1]) * 1024 - base)
    """
)


def test_consolidation_memory_is_bounded_by_largest_tensor_plus_shard(tmp_path):
    # 48 tensors of 4 MB: the model is 48x its largest tensor (192 MB)
    n, numel = 48, 1 << 20
    g = torch.Generator().manual_seed(1)
    state = {WEIGHT: {f"layer{i}.weight": torch.randn(numel // 512, 512, generator=g) for i in range(n)}}
    tag = tmp_path / "ckpt" / "global_step1"
    tag.mkdir(parents=True)
    for r in range(2):
        write_rank_shard(tag, r, 2, rank_fragments(state, world_size=2, rank=r, stage=2, bucket_numel=3 * numel))
    (tag / META_FILE).write_text(meta_for(state, world_size=2, stage=2).to_json())
    del state
    largest = numel * 4
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results = {}
    for fmt, shard in (("safetensors", 16 << 20), ("torch", 16 << 20)):
        out = subprocess.run(
            [sys.executable, "-c", _RSS_SCRIPT, str(tag), str(tmp_path / fmt), fmt, str(shard)],
            capture_output=True, text=True, timeout=120, env=env, check=True,
        )
        results[fmt] = int(out.stdout.strip().splitlines()[-1])
    # safetensors streams: about one tensor read (plus a staging piece) at a time
    assert results["safetensors"] < 3 * largest + (16 << 20), results
    # torch.save needs its shard in memory
    assert results["torch"] < 16 * 2**20 + 3 * largest + (16 << 20), results
    files = sorted((tmp_path / "safetensors").glob("model-*.safetensors"))
    assert len(files) == 12
    back = load_file(str(files[3]))
    assert set(back) == {f"layer{i}.weight" for i in range(12, 16)}
    print("consolidation RSS growth (MB):", {k: round(v / 2**20, 1) for k, v in results.items()})


def test_consolidate_cli_does_not_import_torch_until_it_runs():
    code = "import sys, zerorun.cli.consolidate_cmd; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    out = subprocess.run(
        [sys.executable, "-m", "zerorun", "consolidate", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "--max_shard_size" in out.stdout
