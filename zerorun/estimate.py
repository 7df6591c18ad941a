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
model states: from stage 2 on, up to three gradient staging buckets (`reduce_bucket_size`
elements, or the largest layer if larger); at stage 3 the prefetch bucket and the live gathered
parameters (and one whole layer with `largest_layer`); NVMe optimizer tiles on the host.
Stages 0-1 reduce and gather in place (no buffers). Each is capped at the model's size. Activations are not
model states and are not estimated. Partitioned terms are exactly Ψ/N; the runtime's padding
(less than one element per rank and flat buffer) is not included.

Pure arithmetic: no torch, importable by the launcher and the CLI.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

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

TERMS = ("params", "grads", "master", "optimizer_states")
DEVICES = ("gpu", "cpu", "nvme")
GB = 1e9
GIB = float(2**30)
Offload = Literal["none", "cpu", "nvme"]
# One placed term: (term, device, bytes per element, partitioned i.e. ×Ψ/N rather than ×Ψ).
# Bytes per element are fractional with a partial offload (offload_optimizer.ratio).
Piece = tuple[str, str, float, bool]
# Gradient staging buffers alive at once from stage 2 on (runtime/grad_reduce.py: max_inflight
# collectives outstanding + the buffer being filled).
_REDUCE_STAGING = 3
_MAX_FLAT_NUMEL = 50_000_000  # runtime/flat_stage.py MAX_FLAT_NUMEL (estimate imports no torch)

# Optimizer state bytes per trainable element (fp32 states), by lower-case optimizer name.
_OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adam": 8, "adamw": 8, "fusedadam": 8, "cpuadam": 8, "deepspeedcpuadam": 8, "lamb": 8,
    "onebitadam": 8, "zerooneadam": 8, "onebitlamb": 8, "sparseadam": 8, "adamax": 8, "nadam": 8,
    "radam": 8, "adadelta": 8, "rprop": 8, "muadam": 8, "muadamw": 8,
    "adagrad": 4, "lion": 4, "asgd": 4, "muon": 4, "musgd": 4, "adafactor": 0,
}  # fmt: skip


def optimizer_state_bytes(name: str | None, params: Mapping[str, Any] | None = None) -> tuple[int, str | None]:
    """Bytes of optimizer state per element for an optimizer config -> (bytes, note or None).

    SGD keeps a momentum buffer only with momentum > 0; RMSprop adds one for momentum and one
    for `centered`; Adam-family `amsgrad` adds the running maximum.
    """
    params = dict(params or {})
    if name is None:
        return 8, "no optimizer in the config: Adam/AdamW assumed (8 bytes per element)"
    key = name.lower()
    if key == "sgd":
        momentum = params.get("momentum", 0)
        return (4 if isinstance(momentum, int | float) and momentum > 0 else 0), None
    if key == "rmsprop":
        extra = 4 if isinstance(params.get("momentum", 0), int | float) and params.get("momentum", 0) > 0 else 0
        return 4 + extra + (4 if params.get("centered") is True else 0), None
    if key in _OPTIMIZER_STATE_BYTES:
        base = _OPTIMIZER_STATE_BYTES[key]
        if params.get("amsgrad") is True and key in ("adam", "adamw"):
            base += 4
        note = None
        if key == "adafactor":
            note = "Adafactor keeps factored (row/column) states: counted as 0 bytes per element"
        if key == "muon":
            note = "Muon: 4 bytes (momentum) per element; its Adam-updated parameters need 8"
        return base, note
    return 8, f"optimizer {name!r}: state size unknown, 8 bytes per element (Adam) assumed"


@dataclass(frozen=True)
class BytesPerElement:
    """Bytes per parameter element of each term: the precision and optimizer policy."""

    params: int
    grads: int
    master: int
    optimizer_states: int
    precision: str  # "bf16", "fp16", "fp32" or "paper" (the ZeRO paper's 2 + 2 + 12)
    optimizer: str
    notes: tuple[str, ...] = ()

    @classmethod
    def paper(cls) -> BytesPerElement:
        """The ZeRO paper's model: mixed-precision Adam, 2Ψ + 2Ψ + KΨ with K = 12."""
        return cls(2, 2, 4, 8, precision="paper", optimizer="Adam")

    @classmethod
    def from_config(cls, config: Any) -> BytesPerElement:
        """Follow a config's precision, communication dtype and optimizer (Contract 4)."""
        notes: list[str] = []
        fp16, bf16 = config.fp16.enabled, config.bf16.enabled
        if fp16 is True or bf16 is True:
            precision = "fp16" if fp16 is True else "bf16"
        elif "auto" in (fp16, bf16):
            precision = "bf16" if bf16 == "auto" else "fp16"
            notes.append(f"{precision}.enabled is \"auto\": 16-bit mixed precision assumed")
        else:
            precision = "fp32"
        opt = config.optimizer
        state_bytes, note = optimizer_state_bytes(
            opt.canonical_type if opt is not None else None, opt.params if opt is not None else None
        )
        if note:
            notes.append(note)
        name = opt.canonical_type if opt is not None else "Adam (assumed)"
        if precision == "fp32":
            return cls(4, 4, 0, state_bytes, precision="fp32", optimizer=name, notes=tuple(notes))
        grads = 2 if config.communication_data_type in ("fp16", "bf16") else 4
        return cls(2, grads, 4, state_bytes, precision=precision, optimizer=name, notes=tuple(notes))

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer_states


@dataclass(frozen=True)
class Estimate:
    """Per-rank bytes of model states by device and term, plus buffers (upper bounds)."""

    num_params: int
    world_size: int
    stage: int
    offload_optimizer: Offload
    offload_param: Offload
    bytes_per_element: BytesPerElement
    terms: dict[str, dict[str, float]]  # device -> term -> bytes per rank
    buffers: dict[str, dict[str, float]] = field(default_factory=dict)  # device -> buffer -> bytes
    formulas: dict[str, str] = field(default_factory=dict)  # term -> "4Ψ/N on gpu + 4Ψ/N on cpu"
    notes: tuple[str, ...] = ()
    pieces: tuple[Piece, ...] = ()  # (term, device, bytes per element, partitioned)
    # Share of master + optimizer states (and of their step) on the host with optimizer offload
    # to cpu (offload_optimizer.ratio, "auto" resolved); 1.0: all of it.
    offload_ratio: float = 1.0

    def model_states(self, device: str) -> float:
        """Bytes of model states on `device` ("gpu", "cpu", "nvme") per rank at their peak:
        after the backward, when the gradients exist (Contract 4)."""
        return sum(self.terms.get(device, {}).values())

    def between_steps(self, device: str) -> float:
        """Bytes of model states on `device` between optimizer steps: the GPU's gradients exist
        only from the step's first gradient to the optimizer step (the host's fp32 gradient
        copies of an offloaded optimizer are kept)."""
        transient = self.terms.get(device, {}).get("grads", 0.0) if device == "gpu" else 0.0
        return self.model_states(device) - transient

    def buffer_bytes(self, device: str) -> float:
        return sum(self.buffers.get(device, {}).values())

    def total(self, device: str, *, with_buffers: bool = True) -> float:
        return self.model_states(device) + (self.buffer_bytes(device) if with_buffers else 0.0)

    def formula(self, device: str) -> str:
        """The model states on `device` as a formula: '2Ψ + 14Ψ/N' (replicated + partitioned)."""
        whole = sum(w for _, d, w, p in self.pieces if d == device and not p)
        part = sum(w for _, d, w, p in self.pieces if d == device and p)
        pieces = ([f"{_w(whole)}Ψ"] if whole else []) + ([f"{_w(part)}Ψ/N"] if part else [])
        return " + ".join(pieces) or "0"

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_params": self.num_params,
            "world_size": self.world_size,
            "stage": self.stage,
            "offload_optimizer": self.offload_optimizer,
            "offload_param": self.offload_param,
            "offload_ratio": self.offload_ratio,
            "precision": self.bytes_per_element.precision,
            "optimizer": self.bytes_per_element.optimizer,
            "bytes_per_element": {t: getattr(self.bytes_per_element, t) for t in TERMS},
            "per_rank": {
                d: {**self.terms.get(d, {}), "total": self.model_states(d)} for d in DEVICES
            },
            "point": "per_rank: after the backward (gradients alive, the peak of model states); "
            "between_steps_per_rank: after the optimizer step (GPU gradients freed)",
            "between_steps_per_rank": {d: self.between_steps(d) for d in DEVICES},
            "buffers_per_rank": {d: {**self.buffers.get(d, {}), "total": float(self.buffer_bytes(d))} for d in DEVICES},
            "formulas": dict(self.formulas),
            "formula_per_device": {d: self.formula(d) for d in DEVICES},
            "notes": list(self.notes),
            "activations": "not included",
        }


def _as_config(config: Any) -> Any:
    if config is None:
        return None
    if hasattr(config, "zero_optimization"):
        return config
    if hasattr(config, "config"):  # LoadedConfig
        return config.config
    if isinstance(config, Mapping):
        from zerorun.config import load_config

        return load_config(dict(config)).config
    raise TypeError(f"config must be a ZerorunConfig, LoadedConfig or dict, not {type(config).__name__}")


def _w(width: float) -> str:
    return f"{width:.3g}"


def twin_flow_device_bytes(bpe: BytesPerElement) -> int:
    """GPU bytes per shard element of the part of the optimizer a partial offload keeps on the
    GPU: the fp32 master (none in fp32 training: the parameter shard is the master) + states."""
    return bpe.master + bpe.optimizer_states


def offload_budget_numel(config: Any) -> int:
    """Shard elements per rank whose master + optimizer states fit ``zerorun.offload_gpu_budget_gb``
    (``offload_optimizer.ratio: "auto"``); the runtime keeps that many on the GPU, the estimate too."""
    cfg = _as_config(config)
    budget = float(cfg.zerorun.offload_gpu_budget_gb) * GB
    width = twin_flow_device_bytes(BytesPerElement.from_config(cfg))
    return int(budget // width) if width else 2**62


def _host_share(cfg: Any, stage: int, num_params: int, n: int) -> float:
    """The host's share of master + optimizer states per rank (offload_optimizer.ratio)."""
    ratio = cfg.zero_optimization.offload_optimizer.ratio
    if ratio != "auto":
        return float(ratio)
    shard = num_params / n if stage >= 1 else float(num_params)
    if shard <= 0:
        return 1.0
    return max(0.0, 1.0 - min(shard, offload_budget_numel(cfg)) / shard)


def _zero_size(zero: Any, name: str) -> int:
    """A ``zero_optimization`` size as the runtime takes it: unset or ``auto`` is the schema's
    default (written once, in config/zero_section.py)."""
    from zerorun.config.zero_section import ZeroOptimization

    value = getattr(zero, name) if zero is not None else None
    return int(ZeroOptimization.model_fields[name].default if value in (None, "auto") else value)


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
    default buckets. `largest_layer` (elements) adds the stage-3 working set of one gathered
    layer to the GPU buffers. `offload_ratio` (with `offload_optimizer` cpu): the host's share of
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

    buffers = _buffers(num_params, stage, bpe, zero, opt_dev, par_dev, n, largest_layer, notes)
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
      the parameter shard in fp32 training, as without offload).
    """
    opt_where = {"none": "gpu", "cpu": "cpu", "nvme": "nvme"}[opt_dev]
    par_where = {"none": "gpu", "cpu": "cpu", "nvme": "nvme"}[par_dev]
    master_is_param = (
        stage == 3 and opt_dev == "none" and par_dev == "none" and bpe.master > 0 and bpe.precision != "paper"
    )
    master_width = bpe.master or (4 if opt_dev != "none" else 0)
    pieces: list[Piece] = [
        ("params", par_where, 0 if master_is_param else bpe.params, stage >= 3),
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
    # to 1024, no larger than this rank's shard). Parameters on NVMe are memory-mapped files:
    # no staging buffers.
    if opt_dev == "nvme":
        sub_group = _zero_size(zero, "sub_group_size")
        tile = min(-(-min(sub_group, 2**30) // 1024) * 1024, -(-psi // n))
        from zerorun.config.zero_section import OffloadOptimizer

        buffers = zero.offload_optimizer.buffer_count if zero else OffloadOptimizer.model_fields["buffer_count"].default
        count = max(2, buffers)
        cpu["nvme_optimizer_tiles"] = float(count * tile * (bpe.master + bpe.optimizer_states))
    return {"gpu": gpu, "cpu": cpu, "nvme": {}}


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


_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str | int | float) -> int:
    """A parameter count as people write it: 7.5e9, 7.5B, 350M, 1.3b, 7_000_000_000."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value = float(text)
    else:
        t = str(text).strip().replace("_", "").replace(",", "")
        scale = 1
        if t and t[-1].lower() in _SUFFIXES:
            scale = _SUFFIXES[t[-1].lower()]
            t = t[:-1]
        try:
            value = float(t) * scale
        except ValueError:
            raise ValueError(f"{text!r} is not a count; write e.g. 7.5e9, 7.5B or 350M") from None
    if not value >= 0 or value != value or value == float("inf"):
        raise ValueError(f"{text!r} is not a non-negative count")
    return int(round(value))
