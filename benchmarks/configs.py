"""The catalogue of benchmark configurations: what each one is, and the zerorun config it uses.

A configuration is a name the command line accepts (`--configs plain,fsdp2,zero2`) plus what
the worker needs to build it. The training recipe (model, data, AdamW hyperparameters) is the
same for all and lives in `workload.py`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["BenchConfig", "CATALOGUE", "PRESETS", "select", "run_plan", "zerorun_ds_config", "deep_merge"]

Family = Literal["plain", "ddp", "fsdp2", "zerorun"]


@dataclass(frozen=True)
class BenchConfig:
    name: str
    family: Family
    description: str
    stage: int | None = None  # zerorun: zero_optimization.stage
    offload_optimizer: bool = False  # zerorun: offload_optimizer.device = cpu
    offload_param: bool = False  # zerorun: offload_param.device = cpu (stage 3)
    cpu_offload: bool = False  # FSDP2: CPUOffloadPolicy
    delayed_update: bool = False  # zerorun: zerorun.delayed_param_update (changes the math: docs/offload.md)
    # zerorun: offload_optimizer.ratio (Twin-Flow partial offload, exact): the host's share of
    # the optimizer states; the rest stays on the GPU and steps there at the same time.
    offload_ratio: float = 1.0
    # zerorun: zero_optimization.zenflow with ZENFLOW (changes the math: docs/offload.md)
    zenflow: bool = False
    # plain PyTorch is one process on one GPU whatever --nproc says: its tokens/s per GPU is
    # the baseline every row is compared with.
    single_process: bool = False
    needs_multi_rank: bool = False  # DDP only means something with world > 1
    needs_cuda: bool = False  # FSDP2's CPUOffloadPolicy needs an accelerator
    # torch.compile on each transformer block (`block.compile()` before the trainer is built:
    # the pattern PyTorch recommends with FSDP2); compile time falls in the untimed warm-up.
    compile: bool = False
    # zerorun at world 1 with its real collective path (ZERORUN_DEBUG_COLLECTIVES=1: staging
    # casts, side-stream collectives and event waits, as with several ranks). At world 1 zerorun
    # skips every collective by default while FSDP2 runs its own: this is the fair world-1 row.
    real_collectives: bool = False

    @property
    def offloads(self) -> bool:
        """Host offload: the slow configurations, run last so a call cut short loses least."""
        return self.cpu_offload or self.offload_optimizer or self.offload_param


# ZenFlow as issue 17's target row: DeepSpeed's documented example values (topk_ratio 0.05,
# update_interval 4); columns re-selected every 16 steps.
ZENFLOW = {"topk_ratio": 0.05, "select_strategy": "step", "select_interval": 16, "update_interval": 4}


def _zr(name: str, stage: int, desc: str, **kw: Any) -> BenchConfig:
    return BenchConfig(name=name, family="zerorun", description=desc, stage=stage, **kw)


CATALOGUE: dict[str, BenchConfig] = {
    c.name: c
    for c in [
        BenchConfig(
            "plain", "plain", "PyTorch, fp32 weights, bf16 autocast, fused AdamW", single_process=True
        ),
        BenchConfig("ddp", "ddp", "PyTorch DDP, bf16 autocast, fused AdamW", needs_multi_rank=True),
        BenchConfig("fsdp2", "fsdp2", "FSDP2 per block + root, bf16 params, fp32 reduce"),
        BenchConfig("fsdp2_offload", "fsdp2", "FSDP2 + CPUOffloadPolicy", cpu_offload=True, needs_cuda=True),
        _zr("zero0", 0, "zerorun stage 0, bf16"),
        _zr("zero1", 1, "zerorun stage 1, bf16"),
        _zr("zero2", 2, "zerorun stage 2, bf16"),
        _zr("zero3", 3, "zerorun stage 3, bf16"),
        _zr("zero2_offload_opt", 2, "zerorun stage 2 + CPU optimizer offload", offload_optimizer=True),
        _zr("zero3_offload_opt", 3, "zerorun stage 3 + CPU optimizer offload", offload_optimizer=True),
        # ZeRO-Offload's one-step delayed parameter update: the CPU step overlaps the next
        # forward/backward (issue 7's >= 0.70x target); one-step-stale gradients.
        _zr(
            "zero2_offload_dpu",
            2,
            "zerorun stage 2 + CPU optimizer offload, delayed parameter update",
            offload_optimizer=True,
            delayed_update=True,
        ),
        # Twin-Flow: issue 17's ">= 0.85x at the ratio keeping peak GPU memory <= halfway between
        # full offload and no offload" rows. Stage 2: the peak is the full-offload row's + 12 B
        # (fp32 master + Adam) per element kept on the GPU, to the byte (H200 records), and no
        # offload = full offload + 12 B per parameter: 0.5 (the whole-buffer split keeps 0.498 on
        # the GPU; 25 MB under halfway). Stage 3: its no-offload run keeps no 16-bit shard (the
        # fp32 master is the at-rest parameter), so halfway is ~1.2 GB lower; the GPU groups of a
        # partial offload now do the same (- 2 B per GPU element, + the root group gathered):
        # 0.55 keeps the root group + 9 of 24 blocks (0.438) on the GPU: 0.70 GB under halfway
        # at 0.857x on the H200 (20261201T202221Z; at 0.5 with the old layout it peaked 0.81 GB
        # over; 0.5 now: predicted 0.19 GB under).
        # tests/runtime/test_offload_twinflow.py::test_h200_ratio_rows_keep_the_peak_within_halfway.
        _zr(
            "zero2_offload_ratio",
            2,
            "zerorun stage 2 + CPU optimizer offload of half the states (ratio 0.5, exact)",
            offload_optimizer=True,
            offload_ratio=0.5,
        ),
        _zr(
            "zero3_offload_ratio",
            3,
            "zerorun stage 3 + CPU optimizer offload of 55% of the states (ratio 0.55, exact)",
            offload_optimizer=True,
            offload_ratio=0.55,
        ),
        # +compile (issue 20): every block compiled, for plain, FSDP2 and each zerorun stage;
        # target: each zerorun stage + compile >= FSDP2 + compile minus the noise band.
        BenchConfig(
            "plain_compile",
            "plain",
            "PyTorch, compiled blocks, bf16 autocast, fused AdamW",
            single_process=True,
            compile=True,
        ),
        BenchConfig("fsdp2_compile", "fsdp2", "FSDP2 per block + root, compiled blocks", compile=True),
        *[
            _zr(f"zero{s}_compile", s, f"zerorun stage {s}, bf16, compiled blocks", compile=True)
            for s in range(4)
        ],
        _zr(
            "zero2_zenflow",
            2,
            "zerorun stage 2 + CPU optimizer offload + ZenFlow (top 5 % columns on the GPU, the rest every 4 steps)",
            offload_optimizer=True,
            zenflow=True,
        ),
        *[
            _zr(
                f"zero{s}_collectives",
                s,
                f"zerorun stage {s}, bf16, real collectives at world 1",
                real_collectives=True,
            )
            for s in (2, 3)
        ],
        # Parameters and optimizer both on the host: the article's "ZeRO-3 + CPU offload" and
        # what FSDP2's CPUOffloadPolicy does (it offloads parameters, gradients and the step).
        _zr(
            "zero3_offload_param",
            3,
            "zerorun stage 3 + CPU parameter and optimizer offload",
            offload_optimizer=True,
            offload_param=True,
        ),
    ]
}

PRESETS: dict[str, list[str]] = {
    # For iterating: the baseline, the peer to beat, one zerorun stage (add the one just changed).
    "quick": ["plain", "fsdp2", "zero2"],
    "compile": [n for n, c in CATALOGUE.items() if c.compile],
    "full": list(CATALOGUE),
    "zerorun": [n for n, c in CATALOGUE.items() if c.family == "zerorun"],
    "peers": [n for n, c in CATALOGUE.items() if c.family != "zerorun"],
    # Multi-rank memory mode (zerorun only: the ZeRO formulas are about zerorun's partitions).
    "memory": ["zero1", "zero2", "zero3", "zero2_offload_opt", "zero3_offload_param"],
}


def select(spec: str, world_size: int) -> tuple[list[BenchConfig], list[str]]:
    """Configurations named by `spec` ("quick", "full", "plain,zero3", "quick,zero3", ...).

    Returns (configurations in catalogue order, notes on the ones dropped for this world size).
    Raises ValueError naming an unknown configuration and the valid names.
    """
    wanted: set[str] = set()
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item in PRESETS:
            wanted.update(PRESETS[item])
        elif item in CATALOGUE:
            wanted.add(item)
        else:
            raise ValueError(
                f"unknown configuration {item!r}; presets: {', '.join(PRESETS)}; "
                f"configurations: {', '.join(CATALOGUE)}"
            )
    chosen, notes = [], []
    for name, cfg in CATALOGUE.items():
        if name not in wanted:
            continue
        if cfg.needs_multi_rank and world_size < 2:
            notes.append(f"{name}: skipped, needs --nproc >= 2")
            continue
        chosen.append(cfg)
    return chosen, notes


def run_plan(chosen: list[BenchConfig], repeat_baseline: bool = True) -> list[tuple[BenchConfig, int]]:
    """The order of launches, as (configuration, repeat) pairs: the plain baseline first, then
    the configurations without offload, the baseline again (its second run gives the noise
    band, and comes before the slow offload runs so a deadline does not take it), then the
    offload configurations."""
    plain = [c for c in chosen if c.name == "plain"]
    fast = [c for c in chosen if c.name != "plain" and not c.offloads]
    slow = [c for c in chosen if c.offloads]
    plan = [(c, 1) for c in plain + fast]
    if plain and repeat_baseline:
        plan.append((plain[0], 2))
    return plan + [(c, 1) for c in slow]


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`base` with `override` merged in recursively (dicts merge, other values replace)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def zerorun_ds_config(
    cfg: BenchConfig,
    *,
    micro_batch: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    override: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed-style config dict a zerorun configuration passes to `zerorun.initialize`.

    Bucket sizes and stage-3 knobs are left at the defaults a DeepSpeed user gets, so the
    numbers are what a user sees out of the box; `override` (the command line's
    `--zerorun-override JSON`) changes any key for experiments.
    """
    if cfg.family != "zerorun" or cfg.stage is None:
        raise ValueError(f"{cfg.name} is not a zerorun configuration")
    zero: dict[str, Any] = {"stage": cfg.stage, "overlap_comm": True, "contiguous_gradients": True}
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if cfg.offload_ratio != 1.0:
            zero["offload_optimizer"]["ratio"] = cfg.offload_ratio
    if cfg.zenflow:
        zero["zenflow"] = dict(ZENFLOW)
    if cfg.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    extra = {"zerorun": {"delayed_param_update": True}} if cfg.delayed_update else {}
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": list(betas), "eps": eps, "weight_decay": weight_decay},
        },
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        **extra,
    }
    return deep_merge(ds, override) if override else ds
