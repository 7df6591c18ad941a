"""One try of the largest-model search (benchmarks/largest_model.py): one GPT shape, stage 3 +
parameter offload to the host + optimizer offload to the host or NVMe, `steps` training steps,
in its own process (the parent enforces the time limit and watches host memory).

Prints `STEP i loss seconds` after every step (the parent keeps the last ones if it has to kill
the try) and one `RESULT {json}` line at the end: losses, tokens/s after warm-up, peak GPU
memory (training, and start-up apart: the model's build and initialize), the host's peak resident
set during initialize and during training, and the model-state bytes measured between steps (the CUDA allocator + a census of live
host tensors, independent of zerorun's own report) beside `zerorun estimate`'s figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

__all__ = ["ds_config", "rss_bytes", "host_peak_bytes", "dir_bytes", "main"]


def ds_config(
    optimizer_device: str, micro_batch: int, nvme_path: str | None, sub_group: int
) -> dict[str, Any]:
    """The zero3_offload_param benchmark row's config; with `optimizer_device` "nvme" the
    optimizer's masters and states go to files under `nvme_path`, stepped in tiles of
    `sub_group` elements (a fixed staging size: DeepSpeed's default 1e9 would be 12 GB per
    buffer set)."""
    from benchmarks.configs import CATALOGUE, zerorun_ds_config
    from benchmarks.workload import BETAS, EPS, LR, WEIGHT_DECAY

    opt: dict[str, Any] = {"device": optimizer_device, "pin_memory": True}
    if optimizer_device == "nvme":
        opt.update(nvme_path=nvme_path, buffer_count=4)
    override = {
        "zero_optimization": {"offload_optimizer": opt, "sub_group_size": sub_group},
        "gradient_clipping": 0,
    }
    return zerorun_ds_config(
        CATALOGUE["zero3_offload_param"], micro_batch=micro_batch, lr=LR, betas=BETAS, eps=EPS,
        weight_decay=WEIGHT_DECAY, override=override,
    )  # fmt: skip


def rss_bytes() -> int:
    """This process's resident set now (pinned host memory counts: it is touched and locked)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def host_peak_bytes(reset: bool = False) -> int:
    """This process's peak resident set (VmHWM, what ru_maxrss reports) so far; with `reset`,
    it is then set back to the current RSS (/proc/self/clear_refs 5), so the next read is the
    peak of what follows (a kernel that refuses keeps the whole-process peak)."""
    peak = _status_bytes("VmHWM")
    if reset:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
    return peak


def dir_bytes(path: str | None) -> int:
    """Bytes allocated on disk under `path` (st_blocks: what the files really take)."""
    if not path or not os.path.isdir(path):
        return 0
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def run(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    import zerorun
    from benchmarks.measure import live_tensor_bytes
    from benchmarks.workload import build_model, gpt_model
    from zerorun import estimate

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.init()
        torch.ones(1, device=device)  # the context exists before the baseline
    rss0 = rss_bytes()
    cfg = gpt_model.GPTConfig(
        n_layer=a.layers,
        d_model=a.hidden,
        n_head=a.heads,
        vocab_size=a.vocab,
        seq_len=a.seq,
        micro_batch=a.micro_batch,
    )
    psi = gpt_model.count_parameters(cfg)
    ds = ds_config(a.optimizer, a.micro_batch, a.nvme_path, a.sub_group)
    t0 = time.perf_counter()
    model = build_model(cfg, device, 1234)
    # Start-up, apart from the training peak: the fp32 model this benchmark builds on the GPU
    # (4 B/param: a user's model, not zerorun's), then initialize's own peak above it (the
    # host shards and masters are made one group at a time on the host: ~0 on the GPU).
    build_peak = gpu_model = init_peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        build_peak = torch.cuda.max_memory_allocated(device)
        gpu_model = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    host_before_init = rss_bytes()
    host_peak_bytes(reset=True)
    engine, _, _, _ = zerorun.initialize(model=model, config=ds)
    del model
    init_s = time.perf_counter() - t0
    host_peak_init = host_peak_bytes(reset=True)  # the training peak is counted from here
    if device.type == "cuda":
        init_peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    print(f"INIT {init_s:.1f}", flush=True)
    data = gpt_model.SyntheticTokens(cfg, a.micro_batch, device, seed=1234, rank=0)
    losses: list[float] = []
    times: list[float] = []
    for i in range(a.steps):
        x, y = data.batch(i)
        s0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        value = float(loss.detach().float())  # note: a CPU-GPU sync point per step (steps take seconds)
        times.append(time.perf_counter() - s0)
        losses.append(value)
        print(f"STEP {i} {value:.5f} {times[-1]:.3f}", flush=True)
    # Between steps: gradients released, nothing in flight.
    if device.type == "cuda":
        torch.cuda.synchronize()
    gpu_now = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    host_census = live_tensor_bytes(torch.device("cpu"))
    gpu_census = live_tensor_bytes(device) if device.type == "cuda" else 0
    est = estimate.model_state_bytes(psi, 1, ds)
    timed = times[a.warmup :]
    tokens = a.micro_batch * a.seq
    finite = all(math.isfinite(v) for v in losses)
    k = max(1, min(5, len(losses) // 4))
    falling = finite and sum(losses[-k:]) / k < sum(losses[:k]) / k
    rec = {
        "layers": a.layers,
        "hidden": a.hidden,
        "heads": a.heads,
        "vocab": a.vocab,
        "seq_len": a.seq,
        "micro_batch": a.micro_batch,
        "optimizer_device": a.optimizer,
        "sub_group_size": a.sub_group,
        "params": psi,
        "steps": len(losses),
        "losses": losses,
        "step_s": times,
        "finite": finite,
        "falling": falling,
        "init_s": init_s,
        "tokens_per_s": tokens * len(timed) / sum(timed) if timed else None,
        "gpu_peak_allocated_bytes": torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else None,
        "gpu_peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
        # Start-up: the peak through building the model and initialize (as before), the fp32
        # model's bytes, and initialize's own peak above what was allocated before it.
        "gpu_peak_init_bytes": None if init_peak is None else max(init_peak, build_peak or 0),
        "gpu_model_bytes": gpu_model,
        "gpu_init_growth_bytes": None if init_peak is None else init_peak - (gpu_model or 0),
        "host_rss_before_init_bytes": host_before_init,
        "host_peak_init_bytes": host_peak_init,
        "host_peak_training_bytes": host_peak_bytes(),
        "measured": {
            # CUDA: the allocator; on CPU (the harness test) everything is host memory.
            "gpu_allocated_bytes": gpu_now,
            "gpu_tensor_census_bytes": gpu_census,
            "host_tensor_census_bytes": host_census,
            "host_rss_growth_bytes": rss_bytes() - rss0,
            "nvme_disk_bytes": dir_bytes(a.nvme_path),
        },
        "estimate": {
            "between_steps": {d: est.between_steps(d) for d in ("gpu", "cpu", "nvme")},
            "buffers": {d: est.buffer_bytes(d) for d in ("gpu", "cpu", "nvme")},
            "formula": {d: est.formula(d) for d in ("gpu", "cpu", "nvme")},
        },
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "zerorun_config": ds,
    }
    engine.destroy()
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("layers", "hidden", "heads", "vocab", "seq", "micro-batch", "steps", "warmup", "sub-group"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--optimizer", choices=("cpu", "nvme"), required=True)
    p.add_argument("--nvme-path", default=None)
    a = p.parse_args(argv)
    print("RESULT " + json.dumps(run(a)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
