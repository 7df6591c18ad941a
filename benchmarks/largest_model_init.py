"""The memory `zerorun.initialize` itself needs for the largest-model configuration (stage 3 +
parameter offload + optimizer offload): the host's and the GPU's peak during initialize, apart
from the steady state the training steps reach (benchmarks/largest_model_try.py measures that).

    python -m benchmarks.largest_model_init --layers 16 --hidden 1536          # CPU: host peak only
    python -m benchmarks.largest_model_init --layers 24 --hidden 2048 --out $OUT/init_peak.json  # GPU

Each measurement runs in its own process (`measure` below): the model is built in fp32 where
`--build` says (`host`: on the CPU; `device`: on the training device; `init`: under
`zerorun.zero.Init(remote_device="cpu")`), then the process's peak resident set is reset
(/proc/self/clear_refs 5: VmHWM, what `resource.getrusage().ru_maxrss` reports) and the CUDA
allocator's peak too, `initialize` runs, and the peaks are read. Reported per parameter:

* `host_peak_growth_per_param`: VmHWM during initialize - RSS before it. The user's fp32 model
  (4 B/param) is freed group by group while the host shards and masters fill, so a start-up that
  builds the masters one group at a time needs about what it keeps (bf16 shard 2 + fp32 master 4
  + pinned fp32 gradient 4 + staging 2 = 12 B/param, less the model's 4 B it frees); one that
  held every group's fp32 copy until the masters took them needs 4 B/param more.
* `gpu_peak_growth_per_param` (CUDA): the allocator's peak during initialize - allocated before.
  With optimizer offload the fp32 master shards are built on the host: no 4 B/param term here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

__all__ = ["init_config", "measure", "run_child", "main"]


def init_config(optimizer: str, param: str, nvme_path: str | None) -> dict[str, Any]:
    """Stage 3, bf16, AdamW, offload of the optimizer (`cpu`/`nvme`/`none`) and the parameters
    (`cpu`/`none`); pin_memory as the largest-model benchmark sets it."""
    zero: dict[str, Any] = {"stage": 3}
    if optimizer != "none":
        opt: dict[str, Any] = {"device": optimizer, "pin_memory": True}
        if optimizer == "nvme":
            opt.update(nvme_path=nvme_path, buffer_count=4)
        zero["offload_optimizer"] = opt
    if param != "none":
        zero["offload_param"] = {"device": param, "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "gradient_clipping": 0,
        "steps_per_print": 1_000_000,
    }


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_host_peak() -> bool:
    """VmHWM := current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure(a: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this process (call it in a fresh process: the peaks are process-wide)."""
    import resource

    import torch

    import zerorun
    from benchmarks.workload import gpt_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.ones(1, device=device)  # the CUDA context exists before the baseline
    cfg = gpt_model.GPTConfig(n_layer=a.layers, d_model=a.hidden, n_head=max(1, a.hidden // 128),
                              vocab_size=a.vocab, seq_len=a.seq, micro_batch=1)  # fmt: skip
    psi = gpt_model.count_parameters(cfg)
    ds = init_config(a.optimizer, a.param, a.nvme_path)
    # One tiny initialize first: imports, the process group, the offload worker threads and
    # allocator pools are one-time costs of the process, not of the model's size.
    tiny = gpt_model.GPTConfig(n_layer=1, d_model=64, n_head=1, vocab_size=64, seq_len=8, micro_batch=1)
    zerorun.initialize(model=gpt_model.GPT(tiny), config=ds)[0].destroy()
    torch.manual_seed(1234)
    if a.build == "init":
        with zerorun.zero.Init(config=ds, remote_device="cpu"):
            model = gpt_model.GPT(cfg)
    else:
        with torch.device(device if a.build == "device" else "cpu"):
            model = gpt_model.GPT(cfg)
    if device.type == "cuda":
        torch.cuda.synchronize()
        gpu_before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = _status_kib("VmRSS") * 1024
    reset = _reset_host_peak()
    engine, *_ = zerorun.initialize(model=model, config=ds)
    del model
    hwm = _status_kib("VmHWM") * 1024
    rec: dict[str, Any] = {
        "layers": a.layers,
        "hidden": a.hidden,
        "vocab": a.vocab,
        "params": psi,
        "optimizer_device": a.optimizer,
        "param_device": a.param,
        "build": a.build,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "host_rss_before_bytes": rss_before,
        "host_peak_bytes": hwm,
        "host_peak_reset": reset,
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "host_peak_growth_per_param": (hwm - rss_before) / psi if reset else None,
        "host_rss_after_bytes": _status_kib("VmRSS") * 1024,
    }
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device)
        rec.update(
            gpu_before_bytes=gpu_before,
            gpu_peak_bytes=peak,
            gpu_after_bytes=torch.cuda.memory_allocated(device),
            gpu_peak_growth_per_param=(peak - gpu_before) / psi,
        )
    engine.destroy()
    return rec


def run_child(args: list[str], timeout_s: float = 600) -> dict[str, Any]:
    """`measure` in a fresh Python process; its record."""
    cmd = [sys.executable, "-m", "benchmarks.largest_model_init", "--child", *args]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, env=env)
    for line in res.stdout.splitlines():
        if line.startswith("INIT_PEAK "):
            return json.loads(line[len("INIT_PEAK ") :])
    raise RuntimeError(
        f"initialize measurement failed (exit {res.returncode}):\n{res.stdout[-2000:]}{res.stderr[-4000:]}"
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--optimizer", choices=("cpu", "nvme", "none"), default="cpu")
    p.add_argument("--param", choices=("cpu", "none"), default="cpu")
    p.add_argument("--build", choices=("host", "device", "init"), default="host")
    p.add_argument("--nvme-path", default=None)
    p.add_argument("--out", default=None, help="append the record (JSON line) to this file")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = _parser().parse_args(argv)
    if a.child:
        print("INIT_PEAK " + json.dumps(measure(a)), flush=True)
        return 0
    rec = run_child([x for x in argv if x != "--child"])
    line = json.dumps(rec)
    print(line)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
