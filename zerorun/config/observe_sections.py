"""DeepSpeed's sections for seeing a run and for activation memory, which zerorun acts on:
the monitors (`tensorboard`, `wandb`, `csv_monitor`, `comet`), `flops_profiler` and
`activation_checkpointing` (zerorun.runtime.observe, zerorun.checkpointing;
docs/observability.md).

`observe_rules` is their cross-key check: a monitor enabled without its package installed is
an error when the config is loaded -- before the launcher starts any rank -- not a traceback
from every rank later. Only the package's presence is checked (importlib, nothing imported).
"""

from __future__ import annotations

import importlib.util

from zerorun.config.reader import RawConfig
from zerorun.config.types import Count, Flag, Real, field
from zerorun.config.zero_section import Section

__all__ = [
    "ActivationCheckpointing",
    "Comet",
    "CsvMonitor",
    "FlopsProfiler",
    "Tensorboard",
    "Wandb",
    "MONITOR_EXTRAS",
    "observe_rules",
]

# Monitor section -> (module its backend imports, pip package that provides it).
MONITOR_EXTRAS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "comet": ("comet_ml", "comet-ml"),
}

_NO_CONTIGUOUS = (
    "zerorun keeps each checkpointed activation in its own allocation (PyTorch's caching allocator "
    "reuses them); there is no contiguous buffer to size"
)


class FlopsProfiler(Section):
    enabled: Flag = field(
        False,
        "Profile one optimizer step: FLOPs per module (PyTorch's FLOP counter), forward/backward/step latency, "
        "achieved TFLOP/s and MFU; rank 0 prints the report.",
    )
    recompute_fwd_factor: Real = field(
        0.0,
        "Share of the forward pass recomputed (activation checkpointing).",
        fixed="zerorun counts the recomputation itself (it runs inside the profiled backward)",
    )
    profile_step: Count = field(1, "Profile the step after this many optimizer steps (DeepSpeed's count).")
    module_depth: int = field(-1, "Module depth of the top-modules list and the detailed tree (-1: all).")
    top_modules: Count = field(1, "Number of top modules (by FLOPs) in the report.")
    detailed: Flag = field(True, "Also print the module tree.")
    output_file: str | None = field(None, "File the report is appended to (null: stdout).")


class ActivationCheckpointing(Section):
    partition_activations: Flag = field(
        False,
        "`zerorun.checkpointing.checkpoint`: each rank of the model-parallel group (the `mpu` given to "
        "`configure`) keeps 1/N of every checkpointed input and all-gathers it for the recomputation. "
        "Only for activations replicated across that group (tensor parallelism); no effect without an mpu.",
    )
    cpu_checkpointing: Flag = field(
        False,
        "`zerorun.checkpointing.checkpoint`: checkpointed inputs live in pinned host memory (copied out on a "
        "side stream during forward, prefetched back one block ahead during backward).",
    )
    contiguous_memory_optimization: Flag = field(
        False, "Copy checkpoints into one contiguous buffer.", fixed=_NO_CONTIGUOUS
    )
    number_checkpoints: Count | None = field(
        None, "Number of checkpoints for the contiguous buffer.", fixed=_NO_CONTIGUOUS
    )
    synchronize_checkpoint_boundary: Flag = field(
        False, "Synchronize the device before and after each checkpointed forward (debugging; CUDA only)."
    )
    profile: Flag = field(
        False,
        "Time every checkpointed forward and its recomputation; rank 0 prints the totals with each "
        "`steps_per_print` report (and the status event carries them).",
    )


class Tensorboard(Section):
    enabled: Flag = field(False, "Rank 0 writes loss, lr, grad norm, timers, throughput to TensorBoard (needs `tensorboard`).")
    output_path: str | None = field(None, "Directory of the logs (null: the rank's working directory).")
    job_name: str = field("DeepSpeedJobName", "Sub-directory of `output_path` for this job.")


class CsvMonitor(Section):
    enabled: Flag = field(False, "Rank 0 writes one CSV file per metric (`step,<name>` rows; no package needed).")
    output_path: str | None = field(None, "Directory of the files (null: the rank's working directory).")
    job_name: str = field("DeepSpeedJobName", "Sub-directory of `output_path` for this job.")


class Wandb(Section):
    enabled: Flag = field(False, "Rank 0 logs to Weights & Biases (needs `wandb`; WANDB_MODE=offline keeps it local).")
    group: str | None = field(None, "W&B group.")
    team: str | None = field(None, "W&B team (entity).")
    project: str = field("deepspeed", "W&B project.")


class Comet(Section):
    enabled: Flag = field(False, "Rank 0 logs to Comet (needs `comet-ml`).")
    workspace: str | None = field(None, "Comet workspace.")
    project: str | None = field(None, "Comet project.")
    samples_log_interval: Count = field(100, "Log each metric at most once per this many samples.")
    experiment_name: str | None = field(None, "Experiment name.")
    api_key: str | None = field(None, "Comet API key (better kept out of config files: COMET_API_KEY).")
    experiment_key: str | None = field(None, "Experiment key (to continue an experiment).")
    online: Flag | None = field(None, "Log online (true) or offline.")
    mode: str | None = field(None, "get, create or get_or_create.")


def observe_rules(raw: RawConfig, config: object) -> tuple[list[str], list[str]]:
    """-> (errors, warnings): an enabled monitor whose package is not installed."""
    errors: list[str] = []
    for section, (module, package) in MONITOR_EXTRAS.items():
        if not getattr(getattr(config, section), "enabled", False):
            continue
        if importlib.util.find_spec(module) is None:
            errors.append(
                f"{raw.where((section, 'enabled'))} = true but the {package!r} package is not installed in this "
                f"environment: `pip install {package}` (or `pip install 'zerorun[{section}]'`), or set it to false "
                "(csv_monitor needs no package)"
            )
    return errors, []
