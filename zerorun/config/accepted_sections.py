"""DeepSpeed sections zerorun accepts but does not act on (communication logger, compression, ...).

Real configs carry these; rejecting them would break a user's existing file, and ignoring them
silently would hide that a feature is missing. They are validated (so typos are still caught
where DeepSpeed's documentation lists the keys) and a non-default value produces a notice.
Sections whose key set is large or version-dependent are free-form dictionaries.
"""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from zerorun.config.types import Count, Flag, Real, field
from zerorun.config.zero_section import Section

__all__ = [
    "Aio",
    "CommsLogger",
    "Checkpoint",
    "DataTypes",
    "Eigenvalue",
    "ProgressiveLayerDrop",
    "FREE_FORM_SECTIONS",
]

# Top-level DeepSpeed sections taken as free-form dictionaries: name -> what they configure.
FREE_FORM_SECTIONS: dict[str, str] = {
    "sparse_attention": "DeepSpeed sparse attention kernels",
    "data_efficiency": "DeepSpeed data efficiency (curriculum learning, random-LTD)",
    "curriculum_learning": "legacy curriculum learning",
    "compression_training": "DeepSpeed compression (quantization, pruning, distillation)",
    "quantize_training": "MoQ quantize-aware training",
    "weight_quantization": "post-init weight quantization",
    "elasticity": "DeepSpeed elastic training",
    "pipeline": "DeepSpeed pipeline parallelism",
    "tensor_parallel": "AutoTP tensor parallelism",
    "expert_parallel": "AutoEP expert parallelism",
    "compile": "DeepCompile / torch.compile integration",
    "nebula": "Nebula checkpoint service",
    "timers": "DeepSpeed throughput timers",
    "torch_autocast": "torch.autocast managed by DeepSpeed",
    "autotuning": "DeepSpeed autotuner",
    "hybrid_engine": "DeepSpeed hybrid (train + inference) engine",
}


class Aio(Section):
    block_size: Count = field(1_048_576, "I/O block size in bytes.")
    queue_depth: Count = field(8, "I/O queue depth.")
    thread_count: Count = field(1, "Parallel I/O threads per request.")
    intra_op_parallelism: Count = field(1, "Newer DeepSpeed name of thread_count.")
    single_submit: Flag = field(False, "Submit requests one by one instead of in blocks.")
    overlap_events: Flag = field(True, "Submit requests without waiting for earlier ones.")
    use_gds: Flag = field(False, "Use NVIDIA GPUDirect Storage.")


class CommsLogger(Section):
    enabled: Flag = field(False, "Log communication operations.")
    verbose: Flag = field(False, "Print every operation.")
    prof_all: Flag = field(True, "Profile all operations.")
    debug: Flag = field(False, "Append the caller to each log name.")
    prof_ops: list[str] = field(default_factory=list, description="Operations to profile.")


class Checkpoint(Section):
    tag_validation: str = field("Warn", "Check that checkpoint tags agree across ranks: Ignore, Warn or Fail.")
    load_universal: Flag = field(False, "Load a universal checkpoint.")
    use_node_local_storage: Flag = field(False, "Save per local rank (no shared filesystem needed).")
    parallel_write: dict[str, Flag] = field(default_factory=dict, description="`pipeline_stage`: parallel writes per pipeline stage.")
    writer: dict[str, object] | None = field(None, "DeepSpeed's fast checkpoint writer settings.")

    @field_validator("tag_validation")
    @classmethod
    def _mode(cls, value: str) -> str:
        if value.upper() not in ("IGNORE", "WARN", "FAIL"):
            raise ValueError(f"{value!r} is not a tag_validation mode; allowed: Ignore, Warn, Fail")
        return value


class DataTypes(Section):
    grad_accum_dtype: Literal["fp32", "fp16", "bf16"] | None = field(
        None, "dtype of gradient accumulation (null: the model's dtype)."
    )


class Eigenvalue(Section):
    enabled: Flag = field(False, "Compute eigenvalues for progressive layer drop.")
    verbose: Flag = field(False, "Print eigenvalues.")
    max_iter: Count = field(100, "Power-iteration steps.")
    tol: Real = field(1e-2, "Convergence tolerance.")
    stability: Real = field(1e-6, "Numerical stability term.")
    gas_boundary_resolution: Count = field(1, "Compute every N accumulation boundaries.")
    layer_name: str = field("bert.encoder.layer", "Module path of the layers.")
    layer_num: Count = field(0, "Number of layers.")


class ProgressiveLayerDrop(Section):
    enabled: Flag = field(False, "Progressive layer dropping.")
    theta: Real = field(1.0, "PLD theta.")
    gamma: Real = field(0.001, "PLD gamma.")
