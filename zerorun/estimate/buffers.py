"""Buffers beside the model states: upper bounds of the gradient staging buckets, stage 3's
prefetch and live parameters, ZenFlow's GPU sums and NVMe optimizer tiles, as the config sizes them."""

from __future__ import annotations

from typing import Any

from zerorun.estimate.per_element import BytesPerElement

# Gradient staging buffers alive at once from stage 2 on (runtime/grad_reduce.py: max_inflight
# collectives outstanding + the buffer being filled).
_REDUCE_STAGING = 3
_MAX_FLAT_NUMEL = 50_000_000  # runtime/flat_stage.py MAX_FLAT_NUMEL (estimate imports no torch)


def _zero_size(zero: Any, name: str) -> int:
    """A ``zero_optimization`` size as the runtime takes it: unset or ``auto`` is the schema's
    default (written once, in config/zero_section.py)."""
    from zerorun.config.zero_section import ZeroOptimization

    value = getattr(zero, name) if zero is not None else None
    return int(ZeroOptimization.model_fields[name].default if value in (None, "auto") else value)


def _buffers(
    num_params: int,
    stage: int,
    bpe: BytesPerElement,
    zero: Any,
    opt_dev: str,
    par_dev: str,
    n: int,
    largest_layer: int | None,
    notes: list[str],
) -> dict[str, dict[str, float]]:
    """Upper bounds of the buffers the config sizes, capped at the model (a bucket never
    holds more than every element)."""
    psi = num_params
    reduce = _zero_size(zero, "reduce_bucket_size")
    prefetch = _zero_size(zero, "stage3_prefetch_bucket_size")
    live = _zero_size(zero, "stage3_max_live_parameters")
    if zero is not None and "auto" in (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size):
        notes.append("bucket sizes set to \"auto\": DeepSpeed's defaults assumed")
    gpu: dict[str, float] = {}
    # Stages 0-1 reduce gradients in place in their flat buffers (the grads term) and gather the
    # updated parameters in place: no separate buffers. From stage 2 on, each bucket's gradients
    # are staged in a buffer that is reduce-scattered and freed, with up to _REDUCE_STAGING of
    # them alive (runtime/grad_reduce.py: 2 in flight + the one being filled). A bucket holds
    # whole parameters, so it is at least the largest parameter: --largest-layer bounds that.
    if stage >= 2 and n > 1:  # one rank accumulates into its shard directly: no staging
        if stage == 2:
            # Stages 0-2 cap a flat buffer at 5e7 elements whatever reduce_bucket_size says
            # (runtime/flat_stage.py MAX_FLAT_NUMEL: earlier reduce-scatters, bounded staging).
            bucket = min(max(min(reduce, _MAX_FLAT_NUMEL), largest_layer or 0), psi)
        else:
            # Stage 3 stages one parameter group (a module) per reduce-scatter, whatever
            # reduce_bucket_size says (runtime/stage3/hooks.py): --largest-layer bounds it.
            bucket = min(largest_layer or reduce, psi)
        # One bucket when the model fits in one; otherwise parameters larger than the bucket
        # make more buckets than Ψ / bucket, so count the full three.
        count = (1 if psi <= bucket else _REDUCE_STAGING) if bucket else 0
        gpu["reduce_staging"] = float(count * bucket * bpe.grads)
        if largest_layer is None and bucket < psi:
            notes.append(
                "reduce staging assumes no parameter (at stage 3: no parameter group) is larger than "
                "reduce_bucket_size; give --largest-layer for a bound that holds for any model"
            )
    if stage == 3:
        gpu["prefetch_bucket"] = float(min(prefetch, psi) * bpe.params)
        gpu["live_params"] = float(min(live, psi) * bpe.params)
        if largest_layer:
            # One layer gathered whole, with its full gradient before the reduce-scatter.
            gpu["largest_layer"] = float(largest_layer * (bpe.params + bpe.grads))
    # ZenFlow (zero_optimization.zenflow, with the optimizer on the CPU; runtime/offload/zenflow.py):
    # the GPU sums the unimportant gradients of an interval (fp32, the rank's shard) and holds
    # compact fp32 master + Adam states of the important columns (topk_ratio of each matrix's
    # columns; one-dimensional parameters are all important, so this is a lower bound).
    zf = getattr(zero, "zenflow", None) if zero is not None else None
    if zf is not None and opt_dev == "cpu" and stage >= 1:
        shard = psi / n
        gpu["zenflow_gradient_sum"] = float(4 * shard)
        gpu["zenflow_important_states"] = float((4 + bpe.optimizer_states) * float(zf.topk_ratio) * shard)
        notes.append(
            "zenflow: the GPU also holds the interval's gradient sum (4Ψ/N) and the important columns' fp32 "
            "master + states (topk_ratio × (4 + states) Ψ/N; more with many 1-D parameters)"
        )
    cpu: dict[str, float] = {}
    # NVMe optimizer offload steps tile by tile (runtime/offload/nvme.py): max(2, buffer_count)
    # host buffer sets of master + states for one tile of sub_group_size elements (rounded up
    # to 1024, no larger than this rank's shard). Parameters on NVMe are memory-mapped files.
    if opt_dev == "nvme":
        sub_group = _zero_size(zero, "sub_group_size")
        tile = min(-(-min(sub_group, 2**30) // 1024) * 1024, -(-psi // n))
        from zerorun.config.zero_section import OffloadOptimizer

        buffers = zero.offload_optimizer.buffer_count if zero else OffloadOptimizer.model_fields["buffer_count"].default
        count = max(2, buffers)
        cpu["nvme_optimizer_tiles"] = float(count * tile * (bpe.master + bpe.optimizer_states))
        # The updated parameters go up from a host copy in the parameter dtype, one per shard
        # (runtime/offload/host_placement.py, stage_on_host: the masters live in reused tiles).
        cpu["nvme_param_staging"] = float(-(-psi // n) * bpe.params)
    return {"gpu": gpu, "cpu": cpu, "nvme": {}}
