"""``deepspeed.zero.Init`` keeps the parameter slices where the config's
``zero_optimization.offload_param.device`` says, as DeepSpeed's does (the section, when present,
overrides the ``remote_device`` argument). Found on the GPU path of the peer suites (issue 13):
transformers' ZeRO-3 ``from_pretrained`` passes only the config, so under ``offload_param: cpu``
zerorun kept the whole partitioned model on the GPU where DeepSpeed keeps it in host memory. On
a CPU rank both are the same memory, which is why the CPU runs could not show it: the checks
here read the store device the context was given, and on a GPU the slices' device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from zerorun.compat.deepspeed.runtime.zero.partition_parameters import init_remote_device

ROOT = Path(__file__).resolve().parents[2]
BASE = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def _with_param_offload(device: str) -> dict:
    section = {"device": device, "pin_memory": True, **({"nvme_path": "/tmp/zerorun-nvme"} if device == "nvme" else {})}
    return dict(BASE, zero_optimization={"stage": 3, "offload_param": section})


class _HoldsConfig:  # transformers' HfDeepSpeedConfig keeps the dict in .config
    def __init__(self, config: dict) -> None:
        self.config = config


def test_the_configs_offload_param_device_decides(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_with_param_offload("cpu")))
    cases = [
        # (config, remote_device argument, where DeepSpeed keeps the slices)
        (_with_param_offload("cpu"), None, "cpu"),
        (_with_param_offload("nvme"), None, "nvme"),
        (_with_param_offload("cpu"), "nvme", "cpu"),  # the section overrides the argument
        (_with_param_offload("none"), "cpu", "none"),  # ... also when it says the training device
        (BASE, "cpu", "cpu"),  # no section: the argument
        (BASE, None, None),
        (dict(BASE, zero_optimization={"stage": 3, "offload_param": None}), "cpu", "cpu"),  # null: no section
        (dict(BASE, zero_optimization={"stage": 3, "cpu_offload_param": True}), None, "cpu"),  # old spelling
        (dict(_with_param_offload("cpu"), steps_per_print=float("inf")), None, "cpu"),  # accelerate's config
        (_HoldsConfig(_with_param_offload("cpu")), None, "cpu"),
        (str(path), None, "cpu"),
        (None, "cpu", "cpu"),
        (None, None, None),
    ]
    for cfg, arg, want in cases:
        assert init_remote_device(cfg, arg) == want, (cfg, arg)


_PROBE = r"""
import json, sys
import torch
from zerorun.compat.deepspeed.runtime.zero.partition_parameters import Init
out = {}
for name, cfg in json.loads(sys.argv[1]).items():
    ctx = Init(config_dict_or_path=cfg)
    with ctx:
        layer = torch.nn.Linear(64, 64)
    out[name] = {"store": str(ctx._ctx.store_device), "slice": layer.weight._zerorun_init.shard.device.type,
                 "dtype": str(layer.weight._zerorun_init.shard.dtype)}
print(json.dumps(out))
"""


def test_from_a_config_with_param_offload_the_slices_stay_in_host_memory() -> None:
    """A real ``zero.Init`` context per config, in a child process (it creates the process
    group). On a GPU the slices of the offloaded configs are on the CPU, the others on the GPU."""
    configs = {
        "cpu": dict(_with_param_offload("cpu"), bf16={"enabled": True}),
        "nvme": _with_param_offload("nvme"),
        "none": _with_param_offload("none"),
        "absent": BASE,
    }
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(configs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["cpu"]["store"] == "cpu" and got["nvme"]["store"] == "cpu"
    assert got["none"]["store"] == "None" and got["absent"]["store"] == "None"
    assert got["cpu"]["dtype"] == "torch.bfloat16"  # the dtype rule still holds beside it
    import torch

    if torch.cuda.is_available():
        assert got["cpu"]["slice"] == "cpu" and got["nvme"]["slice"] == "cpu"
        assert got["none"]["slice"] == "cuda" and got["absent"]["slice"] == "cuda"
    else:
        assert {v["slice"] for v in got.values()} == {"cpu"}

