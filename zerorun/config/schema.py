"""The whole config: DeepSpeed's top-level keys plus zerorun's `launcher:` and `zerorun:`.

`ZerorunConfig` attribute names are DeepSpeed's JSON keys, so code reads
`config.zero_optimization.stage` exactly as the user wrote it. Sections the user did not
write are present with DeepSpeed's defaults (never None), except `optimizer` and `scheduler`,
which are None when the training script passes its own.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator

from zerorun.config.accepted_sections import (
    FREE_FORM_SECTIONS,
    Aio,
    Checkpoint,
    CommsLogger,
    DataTypes,
    Eigenvalue,
    ProgressiveLayerDrop,
)
from zerorun.config.launcher_section import LauncherSection
from zerorun.config.observe_sections import (
    ActivationCheckpointing,
    Comet,
    CsvMonitor,
    FlopsProfiler,
    Tensorboard,
    Wandb,
)
from zerorun.config.training_sections import Amp, Bf16, Fp16, OptimizerSection, SchedulerSection
from zerorun.config.types import Auto, Count, Flag, NonNegReal, PositiveCount, Real, field, plain_numbers
from zerorun.config.zero_section import Section, ZeroOptimization
from zerorun.config.zerorun_section import ZerorunSection

__all__ = ["ZerorunConfig", "CommDtype"]

CommDtype = Literal["fp32", "fp16", "bf16"]


def _free_form_field(what: str) -> Any:
    return field(None, f"{what} (accepted; zerorun does not act on it).", acted_on=False)


class ZerorunConfig(Section):
    """A DeepSpeed config (every documented key) plus zerorun's `launcher:` and `zerorun:`."""

    # -- batch size: train_batch_size = micro × gradient_accumulation_steps × world size
    train_batch_size: PositiveCount | Auto | None = field(
        None, "Global batch per optimizer step = micro batch × accumulation steps × world size."
    )
    train_micro_batch_size_per_gpu: PositiveCount | Auto | None = field(
        None, "Samples one rank processes per forward/backward."
    )
    gradient_accumulation_steps: PositiveCount | Auto | None = field(
        None, "Micro batches accumulated before each optimizer step."
    )
    managed_gradient_accumulation: Flag = field(
        True, "DeepSpeed tracks accumulation boundaries itself (false: the caller decides).", acted_on=False
    )

    # -- optimizer, schedule, clipping
    optimizer: OptimizerSection | None = field(None, "The optimizer zerorun builds (null: the script passes its own).")
    scheduler: SchedulerSection | None = field(None, "The learning-rate scheduler (null: none, or the script's own).")
    gradient_clipping: NonNegReal | Auto = field(0.0, "Clip the global gradient norm to this value (0: no clipping).")
    zero_allow_untested_optimizer: Flag = field(
        False, "Allow an optimizer zerorun has not been tested with (e.g. a custom torch optimizer) under ZeRO."
    )
    zero_force_ds_cpu_optimizer: Flag = field(
        True, "Require DeepSpeed's CPU Adam with optimizer offload.", acted_on=False
    )

    # -- precision
    fp16: Fp16 = field(default_factory=Fp16, description="fp16 mixed precision and loss scaling.")
    bf16: Bf16 = field(default_factory=Bf16, description="bf16 mixed precision.")
    amp: Amp = field(default_factory=Amp, description="NVIDIA apex AMP (zerorun uses fp16/bf16 instead).", acted_on=False)
    communication_data_type: CommDtype | None = field(
        None,
        "dtype of gradient reduction: fp32, fp16 or bf16 (null: fp32 gradients). 16-bit halves gradient memory and traffic.",
    )

    # -- ZeRO
    zero_optimization: ZeroOptimization = field(
        default_factory=ZeroOptimization, description="ZeRO stage, buckets, prefetching and offload."
    )

    # -- logging
    steps_per_print: Count = field(
        10,
        "Every N optimizer steps rank 0 prints step, lr, loss, loss scale, grad norm, samples/s and tokens/s "
        "(and every rank reports them to the launcher's live panel); the only host sync of the reports.",
        ge=1,
    )
    wall_clock_breakdown: Flag = field(
        False,
        "Time forward, backward (autograd and the communication it did not hide) and optimizer step with CUDA "
        "events; reported every `steps_per_print` steps (stdout, live panel per rank, monitors).",
    )
    memory_breakdown: Flag = field(False, "Print memory use at points of the step.", acted_on=False)
    dump_state: Flag = field(False, "Print the engine's state after initialisation.", acted_on=False)

    # -- gradient communication details DeepSpeed offers
    prescale_gradients: Flag = field(False, "Scale gradients before the all-reduce.", acted_on=False)
    gradient_predivide_factor: Real = field(1.0, "Divide gradients by this before the all-reduce.", gt=0, acted_on=False)
    gradient_allreduce_op: Literal["mean", "sum"] = field("mean", "Average (mean) or sum gradients.", acted_on=False)
    sparse_gradients: Flag = field(False, "Sparse (CSR) gradients for embeddings.", acted_on=False)
    disable_allgather: Flag = field(False, "Use broadcasts instead of all-gather.", acted_on=False)
    seq_parallel_comm_data_type: CommDtype = field("fp32", "Gradient dtype for sequence parallelism.", acted_on=False)
    sequence_parallel_size: Count = field(1, "Ulysses sequence-parallel degree.", ge=1, acted_on=False)
    use_data_before_expert_parallelism: Flag = field(False, "Order of data and expert parallel groups.", acted_on=False)
    graph_harvesting: Flag = field(False, "Capture CUDA graphs of short kernel sequences.", acted_on=False)
    disable_python_gc: Flag = field(False, "Disable Python's cyclic garbage collector during training.", acted_on=False)
    dataloader_drop_last: Flag = field(False, "Drop the last incomplete batch of the data loader zerorun.initialize builds.")
    vocabulary_size: Count | None = field(None, "Vocabulary size (used by some DeepSpeed features).", acted_on=False)

    # -- seeing the run, activation memory (observe_sections.py; docs/observability.md)
    flops_profiler: FlopsProfiler = field(default_factory=FlopsProfiler, description="DeepSpeed's flops profiler (zerorun.runtime.observe.flops).")
    activation_checkpointing: ActivationCheckpointing = field(
        default_factory=ActivationCheckpointing,
        description="How `zerorun.checkpointing.checkpoint` (DeepSpeed's `deepspeed.checkpointing`) keeps checkpointed activations.",
    )
    tensorboard: Tensorboard = field(default_factory=Tensorboard, description="TensorBoard monitor (rank 0, DeepSpeed's tag names).")
    wandb: Wandb = field(default_factory=Wandb, description="Weights & Biases monitor (rank 0, DeepSpeed's tag names).")
    csv_monitor: CsvMonitor = field(default_factory=CsvMonitor, description="CSV monitor (rank 0, DeepSpeed's file layout).")
    comet: Comet = field(default_factory=Comet, description="Comet monitor (rank 0, DeepSpeed's tag names).")

    # -- DeepSpeed features zerorun accepts but does not implement
    aio: Aio = field(default_factory=Aio, description="Linux AIO settings for NVMe offload.", acted_on=False)
    comms_logger: CommsLogger = field(default_factory=CommsLogger, description="Communication logger.", acted_on=False)
    checkpoint: Checkpoint = field(default_factory=Checkpoint, description="DeepSpeed checkpoint options.", acted_on=False)
    data_types: DataTypes = field(default_factory=DataTypes, description="Gradient accumulation dtype.", acted_on=False)
    eigenvalue: Eigenvalue = field(default_factory=Eigenvalue, description="Eigenvalue computation.", acted_on=False)
    progressive_layer_drop: ProgressiveLayerDrop = field(
        default_factory=ProgressiveLayerDrop, description="Progressive layer drop.", acted_on=False
    )
    sparse_attention: dict[str, Any] | None = _free_form_field(FREE_FORM_SECTIONS["sparse_attention"])
    data_efficiency: dict[str, Any] | None = _free_form_field(FREE_FORM_SECTIONS["data_efficiency"])
    curriculum_learning: dict[str, Any] | None = _free_form_field(FREE_FORM_SECTIONS["curriculum_learning"])
    compression_training: dict[str, Any] | None = _free_form_field(FREE_FORM_SECTIONS["compression_training"])
    quantize_training: dict[str, Any] | None = _free_form_field(FREE_FORM_SECTIONS["quantize_training"])
    weight_quantization: dict[str, Any] | None = _free_form_field(FREE_FORM_SECTIONS["weight_quantization"])
    elasticity: dict[str, Any] | None = _free_form_field(FREE_FORM_SECTIONS["elasticity"])
    pipeline: dict[str, Any] | None = _free_form_field(FREE_FORM_SECTIONS["pipeline"])
    tensor_parallel: dict[str, Any] | None = _free_form_field(FREE_FORM_SECTIONS["tensor_parallel"])
    expert_parallel: dict[str, Any] | None = _free_form_field(FREE_FORM_SECTIONS["expert_parallel"])
    compile: dict[str, Any] | None = _free_form_field(FREE_FORM_SECTIONS["compile"])
    nebula: dict[str, Any] | None = _free_form_field(FREE_FORM_SECTIONS["nebula"])
    timers: dict[str, Any] | None = _free_form_field(FREE_FORM_SECTIONS["timers"])
    torch_autocast: dict[str, Any] | None = _free_form_field(FREE_FORM_SECTIONS["torch_autocast"])
    autotuning: dict[str, Any] | None = _free_form_field(FREE_FORM_SECTIONS["autotuning"])
    hybrid_engine: dict[str, Any] | None = _free_form_field(FREE_FORM_SECTIONS["hybrid_engine"])

    # -- zerorun's own
    launcher: LauncherSection = field(
        default_factory=LauncherSection, description="zerorun: launch options (the command line overrides them)."
    )
    zerorun: ZerorunSection = field(default_factory=ZerorunSection, description="zerorun: runtime options DeepSpeed has no key for.")

    @field_validator(*FREE_FORM_SECTIONS, mode="before")
    @classmethod
    def _free_form_numbers(cls, value: Any) -> Any:
        return plain_numbers(value)

    # -- conveniences the runtime and the estimator share ---------------------------------

    @property
    def mixed_precision(self) -> Literal["fp16", "bf16"] | None:
        """`fp16`/`bf16` when that section is enabled (or `auto`, resolved later), else None (fp32)."""
        if self.fp16.enabled is True:
            return "fp16"
        if self.bf16.enabled is True:
            return "bf16"
        if self.bf16.enabled == "auto":
            return "bf16"
        if self.fp16.enabled == "auto":
            return "fp16"
        return None

    def to_dict(self, *, only_set: bool = True) -> dict[str, Any]:
        """Plain JSON-ready dict that `load_config` accepts again (the user's values, `auto` kept).

        `only_set=False` includes every default as well (the resolved view `print-config` shows).
        """
        return self.model_dump(mode="json", exclude_unset=only_set)
