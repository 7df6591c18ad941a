"""The ZeRO memory model: bytes of model states per GPU and per host (docs/architecture.md, Contract 4).

Ψ = trainable parameters, N = data-parallel ranks. Four terms, each either replicated (×Ψ)
or partitioned (×Ψ/N) depending on the stage, and each on a device (GPU, host memory, NVMe)
depending on offload:

    params            16-bit parameters (fp32 in fp32 training)   ÷N at stage 3, where the
                      fp32 master slice doubles as the parameter (0) unless something is offloaded
    grads             gradients (fp32 unless communication_data_type is 16-bit)  ÷N at stages 2-3
    master            fp32 master weights (none in fp32 training)  ÷N at stages 1-3
    optimizer_states  e.g. Adam's m and v, 8 bytes per element      ÷N at stages 1-3

The numbers are the peak of model states, after the backward: gradients exist from the step's
first gradient to the optimizer step at every stage (`Estimate.between_steps` leaves them out).
`offload_optimizer` moves master and optimizer_states to the host (NVMe with device nvme) and
adds an fp32 host copy of each reduced gradient slice (4Ψ/N; the GPU keeps its own gradients
until the step); `offload_param` (stage 3) moves the 16-bit parameter slices. The term names
are those of the runtime's memory ledger (`zerorun/runtime/memory.py`), so measured bytes
compare term by term.

Buffers are a separate term and an upper bound of what zerorun's runtime holds besides the
model states: at stage 2 up to three gradient staging buckets (`reduce_bucket_size`
elements, or the largest layer if larger); at stage 3 (G = the largest parameter group,
`largest_layer`) the gathered parameters (root group + the running group; with N > 1 the groups
kept by `stage3_max_reuse_distance`; prefetch within `stage3_prefetch_bucket_size` and
`stage3_max_live_parameters`; nothing at one rank when the shard is the parameter), one group's
reduce-scatter staging with N > 1, and one group's full gradients; NVMe optimizer tiles on the host.
Stages 0-1 reduce and gather in place (no buffers). Each is capped at the model's size. Activations are not
model states and are not estimated. Partitioned terms are exactly Ψ/N; the runtime's padding
(less than one element per rank and flat buffer) is not included.

Pure arithmetic: no torch, importable by the launcher and the CLI. One concept per module:

    inputs.py       what the estimate takes: a config in any form, parameter counts, GB/GiB
    per_element.py  bytes per element of each term (precision, optimizer state sizes)
    result.py       the Estimate (terms by device, formulas, as_dict)
    twin_flow.py    the partial optimizer offload's host/GPU split (offload_optimizer.ratio)
    buffers.py      upper bounds of the staging/prefetch/ZenFlow/NVMe-tile buffers
    model_states.py where each term lives (model_state_bytes, estimate_table)
"""

from __future__ import annotations

from zerorun.estimate.inputs import GB, GIB, parse_count
from zerorun.estimate.model_states import estimate_table, model_state_bytes
from zerorun.estimate.per_element import BytesPerElement, optimizer_state_bytes
from zerorun.estimate.result import TERMS, Estimate
from zerorun.estimate.twin_flow import offload_budget_numel, twin_flow_device_bytes

__all__ = [
    "TERMS",
    "BytesPerElement",
    "Estimate",
    "model_state_bytes",
    "optimizer_state_bytes",
    "estimate_table",
    "GB",
    "GIB",
    "parse_count",
    "offload_budget_numel",
    "twin_flow_device_bytes",
]
