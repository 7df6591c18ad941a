"""Schema of `zero_optimization` and its offload sub-sections (DeepSpeed's keys and defaults).

Attribute names are DeepSpeed's JSON keys (`stage3_prefetch_bucket_size`, not DeepSpeed's
internal pydantic name `prefetch_bucket_size`; the short names are accepted as input and
rewritten by `aliases.py`). Defaults are DeepSpeed's. `stages=` says at which ZeRO stages a
key has an effect; `acted_on=False` marks keys zerorun accepts but does not implement.
"""

from __future__ import annotations

import sys
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from zerorun.config.types import Auto, Count, Flag, Real, SizeCount, field, plain_numbers

__all__ = ["Section", "OffloadParam", "OffloadOptimizer", "ZenFlow", "ZeroOptimization", "OffloadDevice"]

OffloadDevice = Literal["none", "cpu", "nvme"]


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, attributes are the JSON keys."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)


def _free_form(value: Any) -> Any:
    return plain_numbers(value)


# What zerorun's runtime does instead of the DeepSpeed knobs it has no use for.
_PARAM_NVME = "zerorun maps each parameter shard's NVMe file into memory: no staging buffers to size"
_OVERLAP = "zerorun always overlaps gradient reduction with the backward pass"


class OffloadParam(Section):
    """`zero_optimization.offload_param`: where the 16-bit parameter shards live (stage 3)."""

    device: OffloadDevice = field("none", "Where parameter shards live: `none` (GPU), `cpu` or `nvme`.")
    nvme_path: str | None = field(None, "Directory on a fast local disk for `device: nvme`.")
    pin_memory: Flag = field(False, "Keep the CPU copies in page-locked memory (faster copies, counts against `ulimit -l`).")
    buffer_count: Count = field(5, "Number of staging buffers for NVMe parameter swapping.", ge=0, fixed=_PARAM_NVME)
    buffer_size: Count = field(100_000_000, "Elements per NVMe parameter staging buffer.", ge=0, fixed=_PARAM_NVME)
    max_in_cpu: Count = field(
        1_000_000_000, "Parameter elements kept in CPU memory when offloading to NVMe.", ge=0, fixed=_PARAM_NVME
    )


class OffloadOptimizer(Section):
    """`zero_optimization.offload_optimizer`: where the fp32 master weights and optimizer states live."""

    device: OffloadDevice = field(
        "none", "Where optimizer states live: `none` (GPU), `cpu` or `nvme`; the optimizer step then runs on the CPU."
    )
    nvme_path: str | None = field(None, "Directory on a fast local disk for `device: nvme`.")
    pin_memory: Flag = field(False, "Keep the CPU buffers in page-locked memory (faster copies, counts against `ulimit -l`).")
    buffer_count: Count = field(4, "Number of staging buffers for NVMe optimizer-state swapping.", ge=0)
    pipeline_read: Flag = field(False, "Overlap reading the next NVMe tile with the current optimizer step.", acted_on=False)
    pipeline_write: Flag = field(False, "Overlap writing the previous NVMe tile with the current optimizer step.", acted_on=False)
    fast_init: Flag = field(False, "Fast optimizer initialisation when offloading to NVMe.", acted_on=False)
    ratio: Real | Auto = field(
        1.0,
        "Twin-Flow partial offload: the fraction (0..1) of each rank's optimizer states (and of their step) kept "
        "on the host; the rest stays on the GPU and steps there, concurrently with the CPU part. Exact math. "
        "zerorun: stages 1-3 with `device: cpu`, split by whole flat buffers (docs/offload.md); DeepSpeed: stage 3 "
        "only, split by `sub_group_size` groups. `\"auto\"` (a zerorun extension): the largest GPU share that fits "
        "`zerorun.offload_gpu_budget_gb`.",
    )
    super_offload: Flag = field(False, "DeepSpeed's Superchip offload mode.", acted_on=False)
    convert_grad_on_cpu: Flag = field(True, "Convert gradients to fp32 on the CPU rather than the GPU.", acted_on=False)
    cpuadam_cores_perc: Real = field(0.8, "Share of CPU cores DeepSpeed's CPU Adam uses with super_offload.", ge=0.0, le=1.0, acted_on=False)


    @field_validator("ratio")
    @classmethod
    def _ratio_range(cls, value: Any) -> Any:
        if value != "auto" and not 0.0 <= value <= 1.0:
            raise ValueError(
                f"{value} is not a fraction: give the share of optimizer states kept on the host, from 0 "
                "(all on the GPU) to 1 (all on the host, the default), or \"auto\""
            )
        return value


class ZenFlow(Section):
    """`zero_optimization.zenflow`: DeepSpeed's ZenFlow (selective updates with CPU offload; changes
    the math). Every DeepSpeed key and its `"auto"` values are accepted and validated as DeepSpeed
    does; docs/offload.md says how zerorun runs it and which keys it does not act on."""

    topk_ratio: Real = field(0.1, "Share (0..1) of the most important gradient columns updated on the GPU every step.")
    select_strategy: Literal["auto", "step", "epoch"] = field(
        "auto", "When important columns are re-selected: every `select_interval` steps or epochs; `auto`: every epoch."
    )
    select_interval: Count | Auto = field(
        "auto", "Steps (strategy `step`) or epochs (`epoch`) between column re-selections; `auto` with strategy `auto`."
    )
    update_interval: Count | Auto = field(
        "auto",
        "Steps between CPU updates of the accumulated unimportant columns (DeepSpeed sets gradient_accumulation_steps "
        "to it); `auto`: adaptive, from `auto_ratio`.",
    )
    overlap_step: Flag = field(False, "Overlap the CPU update with the next forward/backward.", acted_on=False)
    offload: Flag = field(
        False, "Keep the selective (important-column) optimizer states on the CPU too.", acted_on=False
    )
    auto_ratio: Real = field(0.99, "Threshold of the adaptive `update_interval: auto`.", acted_on=False)
    full_warm_up_rounds: Count = field(0, "Steps of full (non-selective) updates before selection starts.", ge=0)
    pt_reserved_cores_perc: Real = field(
        0.5,
        "Share of the CPU cores left to PyTorch's threads; the rest run the ZenFlow CPU optimizer.",
        acted_on=False,
    )
    steps_per_epoch: Count | None = field(
        None, "Steps per epoch for strategy `epoch` (DeepSpeed fills it from its data loader).", ge=1
    )

    @field_validator("topk_ratio", "auto_ratio", "pt_reserved_cores_perc")
    @classmethod
    def _fraction(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{value} is not a fraction: give a number from 0 to 1")
        return value

    @field_validator("select_interval", "update_interval")
    @classmethod
    def _interval(cls, value: Any) -> Any:
        if value != "auto" and value < 1:
            raise ValueError(f"{value}: give a whole number of at least 1, or \"auto\"")
        return value


class ZeroOptimization(Section):
    """`zero_optimization`: which model states are partitioned across data-parallel ranks."""

    stage: Count = field(
        0,
        "ZeRO stage: 0 none (plain data parallel), 1 optimizer states, 2 + gradients, 3 + parameters.",
    )
    overlap_comm: Flag | None = field(
        None,
        "Overlap gradient reduction with the backward pass (DeepSpeed's default: true at stage 3 only).",
        fixed=_OVERLAP,
        fixed_value=True,
    )
    contiguous_gradients: Flag = field(
        True,
        "Copy gradients into one contiguous buffer as they are produced (less fragmentation).",
        stages=(2, 3),
        fixed="zerorun always keeps gradients in contiguous flat buffers",
        fixed_value=True,
    )
    reduce_scatter: Flag = field(
        True,
        "Average gradients with reduce-scatter (each rank gets its slice) instead of all-reduce.",
        stages=(1, 2),
        fixed="zerorun always reduce-scatters partitioned gradients",
        fixed_value=True,
    )
    reduce_bucket_size: SizeCount | Auto = field(500_000_000, "Elements reduced at a time: the size of a gradient bucket.")
    allgather_partitions: Flag = field(
        True,
        "Gather updated parameters with all-gather (true) or a series of broadcasts (false) after the step.",
        stages=(1, 2),
        fixed="zerorun always all-gathers the updated parameters",
        fixed_value=True,
    )
    allgather_bucket_size: Count = field(
        500_000_000,
        "Elements all-gathered at a time after the optimizer step.",
        stages=(1, 2),
        ge=0,
        fixed="zerorun gathers the updated parameters in place, into their flat buffers: no bucket to size",
    )
    sub_group_size: Count = field(
        1_000_000_000,
        "Elements per optimizer sub-group: the tile the optimizer steps at once (the unit of NVMe swapping).",
        ge=0,
    )
    offload_optimizer: OffloadOptimizer = field(
        default_factory=OffloadOptimizer, description="Optimizer-state offload to CPU or NVMe.", stages=(1, 2, 3)
    )
    offload_param: OffloadParam = field(
        default_factory=OffloadParam, description="Parameter offload to CPU or NVMe.", stages=(3,)
    )
    stage3_prefetch_bucket_size: SizeCount | Auto = field(
        50_000_000, "Elements of parameters fetched ahead of use.", stages=(3,)
    )
    stage3_param_persistence_threshold: SizeCount | Auto = field(
        100_000, "Parameters with fewer elements stay unpartitioned (avoids many tiny all-gathers).", stages=(3,)
    )
    stage3_max_live_parameters: Count = field(
        1_000_000_000, "Most gathered parameter elements alive on a GPU at once before releasing.", stages=(3,), ge=0
    )
    stage3_max_reuse_distance: Count = field(
        1_000_000_000, "Do not release a parameter that will be reused within this many elements.", stages=(3,), ge=0
    )
    stage3_gather_16bit_weights_on_model_save: Flag = field(
        False, "Gather the full 16-bit weights when the model is saved (one consolidated file).", stages=(3,)
    )
    stage3_model_persistence_threshold: Count = field(
        sys.maxsize, "Upper bound on unpartitioned (persistent) parameter elements.", stages=(3,), ge=0, acted_on=False
    )
    stage3_module_granularity_threshold: Count = field(
        0, "Modules below this granularity are fetched as one unit.", stages=(3,), ge=0, acted_on=False
    )
    stage3_use_all_reduce_for_fetch_params: Flag = field(
        False, "Fetch parameters with all-reduce instead of all-gather.", stages=(3,), acted_on=False
    )
    stage3_allgather_sequential: Flag = field(
        False, "All-gather parameters one by one, without buckets.", stages=(3,), acted_on=False
    )
    stage3_partition_stream_chunk_size: Count = field(
        0, "Partition huge parameters by streaming chunks of this size.", stages=(3,), ge=0, acted_on=False
    )
    load_from_fp32_weights: Flag = field(
        True, "Initialise fp32 master weights from the checkpoint's fp32 copy.", acted_on=False
    )
    elastic_checkpoint: Flag = field(False, "Legacy elastic checkpoints.", acted_on=False)
    ignore_unused_parameters: Flag = field(
        True, "Tolerate parameters that receive no gradient.", stages=(2,), acted_on=False
    )
    legacy_stage1: Flag = field(False, "DeepSpeed's old stage-1 implementation.", stages=(1,), acted_on=False)
    round_robin_gradients: Flag = field(
        False, "Parallelise gradient copies to the CPU across ranks (offload).", stages=(1, 2), acted_on=False
    )
    use_multi_rank_bucket_allreduce: Flag = field(
        True, "Combine the reduce buckets of several ranks into one all-reduce.", acted_on=False
    )
    compute_grad_norm: Flag = field(True, "Compute the global gradient norm at every step.", stages=(1, 2), acted_on=False)
    parameter_alignment: Flag = field(
        False, "Align every parameter in flat buffers to 16 bytes.", stages=(1, 2), acted_on=False
    )
    zero_hpz_partition_size: Count = field(
        1, "ZeRO++ hierarchical partitioning: ranks in the secondary group.", stages=(3,), ge=0, acted_on=False
    )
    zero_quantized_weights: Flag = field(False, "ZeRO++ quantized weight all-gather.", stages=(3,), acted_on=False)
    zero_quantized_nontrainable_weights: Flag = field(
        False, "ZeRO++ quantized storage of frozen weights.", stages=(3,), acted_on=False
    )
    zero_quantized_gradients: Flag = field(False, "ZeRO++ quantized gradient reduction.", stages=(3,), acted_on=False)
    zeropp_loco_param: dict[str, Any] | None = field(None, "LoCo-ZeRO++ parameters.", stages=(3,), acted_on=False)
    mics_shard_size: int = field(-1, "MiCS shard group size.", stages=(3,), acted_on=False)
    mics_hierarchical_params_gather: Flag = field(False, "MiCS hierarchical all-gather.", stages=(3,), acted_on=False)
    memory_efficient_linear: Flag = field(True, "DeepSpeed's memory-efficient linear layer.", stages=(3,), acted_on=False)
    pipeline_loading_checkpoint: Flag = field(False, "Load checkpoints in pipeline mode.", stages=(3,), acted_on=False)
    override_module_apply: Flag = field(True, "Patch nn.Module.apply to gather parameters.", stages=(3,), acted_on=False)
    log_trace_cache_warnings: Flag = field(False, "Log parameter-trace cache warnings.", stages=(3,), acted_on=False)
    enable_sanity_checks: Flag = field(False, "DeepSpeed internal sanity checks.", acted_on=False)
    save_muon_momentum_buffer_in_memory: Flag = field(
        False, "Keep Muon momentum in memory with NVMe offload.", stages=(3,), acted_on=False
    )
    leaf_module: dict[str, Any] | None = field(None, "Modules treated as ZeRO-3 leaf modules.", stages=(3,), acted_on=False)
    zenflow: ZenFlow | None = field(
        None,
        "DeepSpeed's ZenFlow: top-k gradient columns updated on the GPU every step, the rest accumulated and "
        "updated on the CPU every `update_interval` steps (changes the math; docs/offload.md).",
        stages=(1, 2, 3),
    )

    @field_validator("stage")
    @classmethod
    def _stage_range(cls, value: int) -> int:
        if value not in (0, 1, 2, 3):
            raise ValueError(f"{value} is not a ZeRO stage; allowed: 0, 1, 2, 3")
        return value

    @field_validator("zeropp_loco_param", "leaf_module", mode="before")
    @classmethod
    def _free(cls, value: Any) -> Any:
        return _free_form(value)

    @model_validator(mode="after")
    def _dynamic_defaults(self) -> ZeroOptimization:
        # Unset, overlap_comm is what zerorun does: it always overlaps (DeepSpeed would only at
        # stage 3). Written to __dict__ so it does not count as set by the user (round trips
        # keep the user's values only).
        if self.overlap_comm is None:
            self.__dict__["overlap_comm"] = True
        return self
