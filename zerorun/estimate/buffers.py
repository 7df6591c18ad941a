"""Buffers beside the model states: upper bounds of the gradient staging buckets, stage 3's
gathered parameters, staging and group gradients, ZenFlow's GPU sums and NVMe optimizer tiles, as
the config (and the largest layer or parameter group) sizes them."""

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
    reshard: bool = True,
    accumulating: bool = False,
    partial: bool = False,
) -> dict[str, dict[str, float]]:
    """Upper bounds of the buffers the config sizes, capped at the model (a bucket never
    holds more than every element). `reshard`: zerorun.stage3_reshard_after_forward;
    `accumulating`: gradient accumulation over more than one micro-step (or "auto");
    `partial`: a Twin-Flow partial offload keeps some masters on the GPU."""
    psi = num_params
    reduce = _zero_size(zero, "reduce_bucket_size")
    if zero is not None and "auto" in (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size):
        notes.append("bucket sizes set to \"auto\": DeepSpeed's defaults assumed")
    gpu: dict[str, float] = {}
    if stage == 3:
        gpu.update(_stage3(psi, bpe, zero, reshard, opt_dev, par_dev, n, largest_layer, notes, accumulating, partial))
    # Stages 0-1 reduce gradients in place in their flat buffers (the grads term) and gather the
    # updated parameters in place: no separate buffers. At stage 2 each bucket's gradients are
    # staged in a buffer that is reduce-scattered and freed, with up to _REDUCE_STAGING of them
    # alive (runtime/grad_reduce.py: 2 in flight + the one being filled). A bucket holds whole
    # parameters, so it is at least the largest parameter: --largest-layer bounds that.
    if stage == 2 and n > 1:  # one rank accumulates into its shard directly: no staging
        # Stages 0-2 cap a flat buffer at 5e7 elements whatever reduce_bucket_size says
        # (runtime/flat_stage.py MAX_FLAT_NUMEL: earlier reduce-scatters, bounded staging).
        bucket = min(max(min(reduce, _MAX_FLAT_NUMEL), largest_layer or 0), psi)
        # One bucket when the model fits in one; otherwise parameters larger than the bucket
        # make more buckets than Ψ / bucket, so count the full three.
        count = (1 if psi <= bucket else _REDUCE_STAGING) if bucket else 0
        gpu["reduce_staging"] = float(count * bucket * bpe.grads)
        if largest_layer is None and bucket < psi:
            notes.append(
                "reduce staging assumes no parameter is larger than reduce_bucket_size; give "
                "--largest-layer for a bound that holds for any model"
            )
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


def _stage3(
    psi: int,
    bpe: BytesPerElement,
    zero: Any,
    reshard: bool,
    opt_dev: str,
    par_dev: str,
    n: int,
    largest_layer: int | None,
    notes: list[str],
    accumulating: bool = False,
    partial: bool = False,
) -> dict[str, float]:
    """Stage 3's buffers as runtime/stage3 allocates them, G = the largest parameter group
    (--largest-layer; a module's parameters, usually the root group: embeddings + head):

    * gathered_params (compute dtype) -- Stage3.buffer_peak_bytes' gathered part. One rank with
      the shards on the device and an at-rest shard already in the compute dtype (fp32 training,
      or the optimizer offloaded: no fp32 master on the device) binds the parameters to the
      shard for good (ParamGroup.resident): nothing is gathered. Otherwise the root group stays
      gathered for the pass and the group running now is gathered on demand (2G); with several
      ranks the groups kept after their forward (stage3_max_reuse_distance: kept while twice the
      elements after them stay below it, schedule.keep_after_forward) add at most R/2 + G; with
      something to overlap (several ranks, or parameters offloaded) prefetch adds groups while
      fewer than stage3_prefetch_bucket_size elements are ahead (at most that + G) and never
      beyond stage3_max_live_parameters. stage3_reshard_after_forward false keeps every group.
    * reduce_staging (reduce dtype) -- several ranks: one group's staging buffer alive at a
      time (hooks.py retires the previous group's reduce-scatter before the next fills its
      buffer), with gradient accumulation plus a shard-sized receive buffer (G/N) that is added
      to the shard. One rank writes the gradient shard directly on the first micro-step; later
      ones add a concatenation of the group's gradients (G, compute dtype) to it
      (ZERORUN_DEBUG_COLLECTIVES=1 stages one group instead, in place).
    * param_uploads (compute dtype; parameters offloaded) -- the device copies of the host
      shards that gathers in flight read: (G + prefetched) / N.
    * group_grads (compute dtype) -- a group's full gradients (p.grad) from its backward to its
      reduction: G. Not in the runtime's own ledger (autograd allocates them).
    """
    group = min(largest_layer if largest_layer else _zero_size(zero, "reduce_bucket_size"), psi)
    if not largest_layer and group < psi:
        notes.append(
            "stage 3 buffers assume no parameter group (a module's parameters; the root group holds the "
            "embeddings and head) is larger than reduce_bucket_size; give --largest-layer (the largest group's "
            "elements) for a bound that holds for any model"
        )
    out: dict[str, float] = {}
    # (a Twin-Flow partial offload's GPU groups too: their fp32 master is the at-rest parameter,
    # gathered with a cast even at one rank)
    masters_on_device = (opt_dev == "none" or partial) and bpe.master > 0
    prefetch = _zero_size(zero, "stage3_prefetch_bucket_size")
    ahead = 0  # elements prefetched (gathering or gathered ahead of the running group)
    if prefetch > 0 and (n > 1 or par_dev != "none"):
        ahead = min(prefetch + group, _zero_size(zero, "stage3_max_live_parameters"))
    if n == 1 and par_dev == "none" and not masters_on_device:
        gathered = 0
    elif not reshard:
        gathered = psi
    else:
        gathered = 2 * group + ahead
        if n > 1:
            reuse = _zero_size(zero, "stage3_max_reuse_distance")
            if reuse > 0:
                gathered += min(reuse // 2 + group, psi)
        gathered = min(gathered, psi)
    out["gathered_params"] = float(gathered * bpe.params)
    if par_dev != "none":
        # each gather in flight reads its shard from a device upload of the host shard
        # (offload/params.py HostParamStore.fetch), dropped at the group's wait: the running
        # group's and the prefetched ones'
        out["param_uploads"] = float(min(group + ahead, psi) / n * bpe.params)
    if n > 1:
        # + a shard-sized receive buffer added to the shard on later micro-steps
        out["reduce_staging"] = float(group * bpe.grads * (1 + (1 / n if accumulating else 0)))
    elif accumulating:
        # one rank, later micro-steps: the concatenated gradients (compute dtype) added to the shard
        out["reduce_staging"] = float(group * bpe.params)
    out["group_grads"] = float(group * bpe.params)
    return out
