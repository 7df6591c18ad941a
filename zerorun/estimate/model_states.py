"""Where each model-state term lives and how wide it is, by stage and offload: the per-rank
bytes (`model_state_bytes`) and the table of every stage × offload choice (`estimate_table`)."""

from __future__ import annotations

from typing import Any

from zerorun.estimate.buffers import _buffers
from zerorun.estimate.inputs import _as_config
from zerorun.estimate.per_element import BytesPerElement
from zerorun.estimate.result import DEVICES, TERMS, Estimate, Offload, Piece, _w
from zerorun.estimate.twin_flow import _host_share


def model_state_bytes(
    num_params: int,
    world_size: int,
    config: Any = None,
    *,
    stage: int | None = None,
    offload_optimizer: Offload | None = None,
    offload_param: Offload | None = None,
    offload_ratio: float | None = None,
    largest_layer: int | None = None,
    bytes_per_element: BytesPerElement | None = None,
) -> Estimate:
    """Bytes per rank of params / grads / master / optimizer_states on GPU, CPU and NVMe.

    `config` (a ZerorunConfig, LoadedConfig or DeepSpeed dict) gives the precision, optimizer,
    stage, offload and bucket sizes; keyword arguments override it. Without a config: the
    ZeRO paper's model (2 + 2 + 12 bytes per element), stage 0, no offload, DeepSpeed's
    default buckets. `largest_layer` (elements): the largest parameter (stage 2) or parameter
    group (stage 3: a module's parameters, usually the root group's embeddings + head), which
    sizes the staging and gathered-parameter buffers (`reduce_bucket_size` stands in without it). `offload_ratio` (with `offload_optimizer` cpu): the host's share of
    master + optimizer states (and of the host gradient copy); the config's
    `offload_optimizer.ratio` by default, `"auto"` resolved with `zerorun.offload_gpu_budget_gb`.
    """
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    cfg = _as_config(config)
    zero = cfg.zero_optimization if cfg is not None else None
    bpe = bytes_per_element or (BytesPerElement.from_config(cfg) if cfg is not None else BytesPerElement.paper())
    stage = stage if stage is not None else (zero.stage if zero is not None else 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    opt_dev: Offload = offload_optimizer or (zero.offload_optimizer.device if zero is not None else "none")
    par_dev: Offload = offload_param or (zero.offload_param.device if zero is not None else "none")
    notes = list(bpe.notes)
    from zerorun.config.rules import offload_in_effect

    # Offload has an effect only where the stage partitions the term (config/rules.py).
    acting = offload_in_effect(stage, opt_dev, par_dev)
    for key, asked, acts in zip(("offload_optimizer", "offload_param"), (opt_dev, par_dev), acting, strict=True):
        if asked != acts:
            notes.append(f"{key} has no effect at stage {stage}")
    opt_dev, par_dev = acting

    psi, n = float(num_params), world_size
    ratio = 1.0
    if opt_dev == "cpu":
        if offload_ratio is not None:
            ratio = float(offload_ratio)
        elif cfg is not None:
            ratio = _host_share(cfg, stage, num_params, n)
    if ratio < 1.0:
        notes.append(
            f"partial offload (Twin-Flow): {ratio:.3g} of the fp32 masters and optimizer states (and the host "
            f"gradient copy) on the host, {1 - ratio:.3g} on the GPU; the runtime splits by whole flat buffers, "
            "so its host share is at least this, within one flat buffer"
        )
    pieces = _pieces(stage, bpe, opt_dev, par_dev, ratio)
    if any(term == "params" and width == 0 for term, _, width, _ in pieces) and bpe.params:
        notes.append(
            "stage 3 with master and parameter slices on the GPU: the fp32 master slice is the at-rest "
            "parameter (the all-gather casts it to 16 bits), so no separate 16-bit parameter slice"
        )
    terms: dict[str, dict[str, float]] = {d: dict.fromkeys(TERMS, 0.0) for d in DEVICES}
    texts: dict[str, list[str]] = {term: [] for term in TERMS}
    for term, device, width, part in pieces:
        terms[device][term] += width * (psi / n if part else psi)
        texts[term].append(f"{f'{_w(width)}Ψ' if width else '0'}{'/N' if part and width else ''} on {device}")
    formulas = {term: " + ".join(texts[term]) for term in TERMS}

    reshard = bool(cfg.zerorun.stage3_reshard_after_forward) if cfg is not None else True
    buffers = _buffers(
        num_params, stage, bpe, zero, opt_dev, par_dev, n, largest_layer, notes, reshard, _accumulating(cfg, n),
        partial=opt_dev == "cpu" and ratio < 1.0,
    )
    if stage == 3 and zero is not None and zero.stage3_param_persistence_threshold not in (0, "auto"):
        notes.append(
            "stage 3 keeps parameters smaller than stage3_param_persistence_threshold unpartitioned "
            "(not counted: depends on the model's shapes)"
        )
    return Estimate(
        num_params=num_params,
        world_size=world_size,
        stage=stage,
        offload_optimizer=opt_dev,
        offload_param=par_dev,
        bytes_per_element=bpe,
        terms=terms,
        buffers=buffers,
        formulas=formulas,
        notes=tuple(notes),
        pieces=tuple(pieces),
        offload_ratio=ratio,
    )


def _accumulating(cfg: Any, n: int) -> bool:
    """More than one micro-step per optimizer step: gradient_accumulation_steps > 1 or "auto",
    or derived from train_batch_size / (micro batch × N)."""
    if cfg is None:
        return False
    accum = cfg.gradient_accumulation_steps
    if accum is None:
        train, micro = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu
        if isinstance(train, int) and isinstance(micro, int) and micro > 0:
            return train // (micro * n) > 1
        return False
    return accum == "auto" or (isinstance(accum, int) and accum > 1)


def _pieces(stage: int, bpe: BytesPerElement, opt_dev: Offload, par_dev: Offload, ratio: float = 1.0) -> list[Piece]:
    """Where each term lives and how wide it is, following the runtime as built (Contract 4).

    * params: replicated 16-bit buffers at stages 0-2; at stage 3 a slice per rank -- except
      that with master and parameter slices both on the GPU (no offload) the fp32 master slice
      *is* the at-rest parameter (runtime/stage3/build.py; the all-gather casts it), so there
      is no 16-bit copy. The ZeRO paper's model keeps its 2Ψ/N.
    * grads: on the GPU at every stage (full at 0-1, a slice at 2-3), alive from the step's
      first gradient to the optimizer step. The CPU optimizer (offload_optimizer) steps from an
      fp32 host copy of each reduced slice (runtime/offload/host_placement.py, allocated once and
      kept), while the GPU keeps its slice until the step.
    * master, optimizer_states: on the GPU, or with the optimizer on the host/NVMe. fp32
      training keeps no master on the GPU (the parameter shard is the master) but an offloaded
      optimizer steps on an fp32 host master.
    * a partial offload (ratio r < 1, device cpu) keeps r of master, states and host gradient
      copy on the host and the rest of master and states on the GPU (the GPU part's master is
      the parameter shard in fp32 training, as without offload; at stage 3 with parameters on
      the GPU it is the at-rest parameter in 16-bit training too: 16-bit slices for r only).
    """
    opt_where = {"none": "gpu", "cpu": "cpu", "nvme": "nvme"}[opt_dev]
    par_where = {"none": "gpu", "cpu": "cpu", "nvme": "nvme"}[par_dev]
    master_is_param = (
        stage == 3 and opt_dev == "none" and par_dev == "none" and bpe.master > 0 and bpe.precision != "paper"
    )
    master_width = bpe.master or (4 if opt_dev != "none" else 0)
    params_width = 0 if master_is_param else bpe.params
    if stage == 3 and opt_dev == "cpu" and ratio < 1.0 and par_dev == "none" and bpe.master > 0 and bpe.precision != "paper":
        params_width = bpe.params * ratio  # the GPU part's fp32 master is its at-rest parameter, as without offload
    pieces: list[Piece] = [
        ("params", par_where, params_width, stage >= 3),
        ("grads", "gpu", bpe.grads, stage >= 2),
    ]
    if opt_dev == "cpu" and ratio < 1.0:
        return pieces + [
            ("grads", "cpu", 4 * ratio, True),
            ("master", "gpu", bpe.master * (1 - ratio), stage >= 1),
            ("master", "cpu", master_width * ratio, stage >= 1),
            ("optimizer_states", "gpu", bpe.optimizer_states * (1 - ratio), stage >= 1),
            ("optimizer_states", "cpu", bpe.optimizer_states * ratio, stage >= 1),
        ]
    if opt_dev != "none":
        pieces.append(("grads", "cpu", 4, True))
    pieces += [
        ("master", opt_where, master_width, stage >= 1),
        ("optimizer_states", opt_where, bpe.optimizer_states, stage >= 1),
    ]
    return pieces


def estimate_table(
    num_params: int,
    gpus_per_node: int,
    nodes: int,
    config: Any = None,
    *,
    largest_layer: int | None = None,
) -> list[tuple[int, str, Estimate]]:
    """Every stage × offload choice for one cluster shape: [(stage, offload label, Estimate)].

    Offload labels: "none", "optimizer" (offload_optimizer cpu), "optimizer+params" (both on
    the CPU; stage 3 only). With a config, its precision, optimizer and buckets are used.
    """
    world = gpus_per_node * nodes
    rows: list[tuple[int, str, Estimate]] = []
    for stage in (0, 1, 2, 3):
        choices: list[tuple[str, Offload, Offload]] = [("none", "none", "none")]
        if stage >= 1:
            choices.append(("optimizer", "cpu", "none"))
        if stage == 3:
            choices.append(("optimizer+params", "cpu", "cpu"))
        for label, opt, par in choices:
            est = model_state_bytes(
                num_params,
                world,
                config,
                stage=stage,
                offload_optimizer=opt,
                offload_param=par,
                largest_layer=largest_layer,
            )
            rows.append((stage, label, est))
    return rows
