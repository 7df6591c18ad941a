"""DeepSpeed's checkpoint files beside zerorun's, for the tools that read them.

Under ``--deepspeed-compat`` (``deepspeed.DeepSpeedEngine.save_checkpoint``) every rank adds its
DeepSpeed files to the temporary tag directory once zerorun's own files are written there, BEFORE
the save commits (``before_commit`` of checkpoint/sharded.py): the directory is renamed into place
and ``latest`` moved only when both layouts are complete, so a crash never leaves ``latest``
naming a half-written DeepSpeed layout::

    SAVE_DIR/zero_to_fp32.py                                   the recovery script (rank 0)
    SAVE_DIR/global_step{N}/
        mp_rank_00_model_states.pt                             stages 0-2 (rank 0): ``module``
        zero_pp_rank_{r}_mp_rank_00_model_states.pt            stage 3 (every rank)
        [bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt     stages 1-3 (every rank)

What they hold (DeepSpeed's keys, what ``zero_to_fp32.py``, DeepSpeed's loader and scripts read):

* model states: ``module`` (stages 0-2: the model's ``state_dict()`` in the compute dtype, as
  DeepSpeed's engine saves it; stage 3: the buffers, and every parameter as the empty
  placeholder DeepSpeed's partitioned parameters hold, which its loader matches by key), ``buffer_names``, ``param_shapes`` (one ordered dict per
  optimizer param group: its trainable parameters in order), ``shared_params`` (tied aliases),
  ``frozen_param_shapes`` / ``frozen_param_fragments`` (frozen parameters in fp32: whole at
  stages 0-2, this rank's ``ceil(numel / world)`` slice at stage 3 -- DeepSpeed writes them only
  from stage 2 and in 16 bits; here ``zero_to_fp32.py`` gives every stage's frozen parameters, in
  fp32 like the rest), ``ds_version``, ``ds_config``, the step counters;
* optimizer states (``optimizer_state_dict``), per optimizer param group, in DeepSpeed's
  partitioning of that group:

  - stages 1-2 (DeepSpeed's ``DeepSpeedZeroOptimizer.state_dict()``, rigid form): the group's
    trainable parameters flattened in order, padded to a multiple of ``2 x world``, cut into
    ``world`` equal partitions; ``single_partition_of_fp32_groups`` = this rank's partition of
    the fp32 masters without the padding, ``base_optimizer_state`` = the torch optimizer's
    ``state_dict()`` over those partitions (``state[g]``: ``step`` and ``exp_avg`` /
    ``exp_avg_sq`` -- every elementwise state zerorun keeps -- over the padded partition;
    ``param_groups[g]``: the hyperparameters), ``group_paddings``, ``partition_count``,
    ``zero_stage``, ``clip_grad``, ``dynamic_loss_scale``, ``overflow``, ``ds_version``;
  - stage 3 (``DeepSpeedZeroOptimizer_Stage3.state_dict()``): ``fp32_flat_groups`` = per group,
    this rank's ``ceil(numel / world)`` slice of each parameter, zero-padded, concatenated;
    ``optimizer_state_dict`` = the torch optimizer's state over those flat groups (same keys);
    ``partition_count``, ``zero_stage``, ``dynamic_loss_scale``, ``overflow``;
  - both: ``loss_scaler``, DeepSpeed's own scaler object (``LossScaler`` /
    ``DynamicLossScaler`` with zerorun's scale, iteration and hysteresis state), written by class
    path (`DeepSpeedObject`) so that DeepSpeed need not be installed; its ZeRO-3 loader requires it.

Each group's parameters are in the order the script gave them to the optimizer (DeepSpeed
places partitions by position); the stage-3 ``module`` holds every parameter as the empty
placeholder DeepSpeed's partitioned parameters hold. With that, real DeepSpeed's
``load_checkpoint`` resumes from these files and continues exactly as zerorun does
(scripts/deepspeed_resume_check.py). `read_optim_states` reads them back into whole
per-parameter tensors (DeepSpeed's own checkpoints too, where they follow this layout).

Every value is read from zerorun's own shards (``CheckpointReader``), so the fp32 weights are
exactly what zerorun's consolidation gives and the moments exactly zerorun's. Not written, being
bookkeeping that only DeepSpeed's live engine has: ``param_slice_mappings`` (universal
checkpoints), the lr scheduler; DeepSpeed's stage-3 sub-groups are one per param group (its
default ``sub_group_size`` of 1e9 elements splits larger groups). Resuming in zerorun, at any
world size, uses zerorun's files. Cost: the fp32
weights and each optimizer state once more (4 bytes per parameter per state over all ranks), plus
the 16-bit model in rank 0's model states at stages 0-2. Each file is written under a temporary
name and renamed.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import stat
import types
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerorun.errors import CheckpointError

from .format import BUFFER, OPTIM_PREFIX, WEIGHT, CheckpointMeta, dtype_from_name
from .store import CheckpointReader

__all__ = [
    "DS_VERSION",
    "RECOVERY_SCRIPT",
    "optim_file",
    "model_states_file",
    "write_rank_files",
    "copy_recovery_script",
    "DeepSpeedObject",
    "DeepSpeedOptimStates",
    "load_file",
    "loss_scaler_object",
    "read_fp32_state_dict",
    "read_optim_states",
]

DS_VERSION = "0.16.4+zerorun"  # zerorun.compat.COMPAT_VERSION (the runtime does not import compat)
RECOVERY_SCRIPT = "zero_to_fp32.py"
_COMPUTE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def optim_file(rank: int, precision: str) -> str:
    return f"{'bf16_' if precision == 'bf16' else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def model_states_file(rank: int, stage: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"


@dataclass
class DeepSpeedObject:
    """An object of one of DeepSpeed's classes, by its import path, with its attributes: written as
    that class (DeepSpeed's loader gets its own object back, e.g. the loss scaler its ZeRO-3
    optimizer reads), without DeepSpeed being installed; read back as this where it is not."""

    path: str  # e.g. "deepspeed.runtime.fp16.loss_scaler.LossScaler"
    attributes: dict[str, object]


class _Pickler(pickle._Pickler):  # the Python pickler: it lets a class be named without importing it
    def save(self, obj: object, save_persistent_id: bool = True) -> None:
        if isinstance(obj, DeepSpeedObject):  # what pickling an instance of that class writes
            module, _, name = obj.path.rpartition(".")
            self.write(pickle.GLOBAL + f"{module}\n{name}\n".encode())  # type: ignore[attr-defined]
            self.save(())
            self.write(pickle.NEWOBJ)  # type: ignore[attr-defined]
            self.save(obj.attributes)
            self.write(pickle.BUILD)  # type: ignore[attr-defined]
            return
        super().save(obj, save_persistent_id)  # type: ignore[misc]


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            if module.split(".")[0] != "deepspeed":
                raise
            return _standin_class(f"{module}.{name}")


def _standin_class(path: str) -> type:
    """Where DeepSpeed is not installed, its objects load as DeepSpeedObject(path, attributes)."""

    class Standin(DeepSpeedObject):
        def __new__(cls, *args: object) -> Any:
            """Unpickling calls it: with no arguments for an object (then __setstate__ with its
            attributes), with the value for an enum (DeepSpeed's ZeroStageEnum: the value is
            what counts), with the fields for a namedtuple (kept as ``args``)."""
            if len(args) == 1 and isinstance(args[0], (bool, int, float, str)):
                return args[0]
            obj = object.__new__(cls)
            obj.path, obj.attributes = path, ({"args": args} if args else {})
            return obj

        def __init__(self, *args: object) -> None:  # fields set in __new__
            pass

        def __setstate__(self, state: dict[str, object]) -> None:
            self.attributes.update(state)

    return Standin


_PICKLE = types.ModuleType("zerorun_deepspeed_pickle")
_PICKLE.Pickler = _Pickler  # type: ignore[attr-defined]
_PICKLE.Unpickler = _Unpickler  # type: ignore[attr-defined]
_PICKLE.load = pickle.load  # type: ignore[attr-defined]


def _save(obj: object, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f, pickle_module=_PICKLE)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """One DeepSpeed-layout file (``torch.load``; DeepSpeed's objects in it as `DeepSpeedObject`
    where DeepSpeed is not installed)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise CheckpointError(f"{path}: cannot read ({err})") from err


def loss_scaler_object(
    scale: float, *, dynamic: bool, state: dict[str, float | int | bool] | None = None
) -> DeepSpeedObject:
    """DeepSpeed's loss scaler with zerorun's scaler state: ``LossScaler`` (static: bf16, fp32,
    fp16 with a fixed ``loss_scale``) or ``DynamicLossScaler`` (fp16) with its attributes --
    ``state``: cur_iter, last_overflow_iter, window, min_scale, hysteresis, cur_hysteresis,
    consecutive_hysteresis, raise_error_at_min_scale."""
    base = "deepspeed.runtime.fp16.loss_scaler."
    if not dynamic:
        return DeepSpeedObject(base + "LossScaler", {"cur_scale": float(scale), "dynamic": False})
    st = state or {}
    return DeepSpeedObject(base + "DynamicLossScaler", {
        "cur_scale": float(scale), "dynamic": True, "cur_iter": int(st.get("cur_iter", 0)),
        "last_overflow_iter": int(st.get("last_overflow_iter", -1)), "scale_factor": 2.0,
        "scale_window": int(st.get("window", 1000)), "min_scale": float(st.get("min_scale", 1.0)),
        "delayed_shift": int(st.get("hysteresis", 2)), "cur_hysteresis": int(st.get("cur_hysteresis", 2)),
        "consecutive_hysteresis": bool(st.get("consecutive_hysteresis", False)),
        "raise_error_at_min_scale": bool(st.get("raise_error_at_min_scale", True)), "dtype": torch.float16,
    })


def _flat_range(reader: CheckpointReader, kind: str, names: list[str], lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of `kind` over `names` flattened one after another (zeros past the end,
    and where a parameter has no such state)."""
    out = torch.zeros(hi - lo, dtype=torch.float32)
    offset = 0
    for name in names:
        n = reader.numel(name)
        s, e = max(lo, offset), min(hi, offset + n)
        if s < e and reader.has(name, kind):
            reader.read_into(name, kind, s - offset, e - offset, out[s - lo : e - lo])
        offset += n
    return out


def _stage3_slices(
    reader: CheckpointReader, names: list[str], rank: int, world: int, kind: str = WEIGHT
) -> list[torch.Tensor]:
    """Rank ``rank``'s ``ceil(numel / world)`` slice of each parameter's `kind`, zero-padded."""
    out = []
    for name in names:
        n = reader.numel(name)
        chunk = math.ceil(n / world)
        piece = torch.zeros(chunk, dtype=torch.float32)
        s, e = min(rank * chunk, n), min((rank + 1) * chunk, n)
        if s < e and reader.has(name, kind):
            reader.read_into(name, kind, s, e, piece[: e - s])
        out.append(piece)
    return out


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float32)  # a group with no parameters


def _stage12_bounds(total: int, rank: int, world: int) -> tuple[int, int, int]:
    """DeepSpeed's ZeRO-1/2 partition of a group of `total` elements: (start, size, padding)."""
    size = (math.ceil(total / (2 * world)) * 2 * world) // world
    lo = rank * size
    padding = size if total <= lo else max(0, lo + size - total)
    return lo, size, padding


def _scalars(meta: CheckpointMeta, group: int) -> dict[str, object]:
    """The group's non-elementwise optimizer state (Adam's ``step``) as torch keeps it."""
    saved = meta.optimizer.get("scalar_state") or []
    out: dict[str, object] = {}
    for key, value in (saved[group] if group < len(saved) else {}).items():
        out[key] = torch.tensor(float(value)) if key == "step" and isinstance(value, (int, float)) else value
    return out


def _hyper(meta: CheckpointMeta, group: int) -> dict[str, object]:
    groups = meta.optimizer.get("param_groups") or []
    out = dict(groups[group] if group < len(groups) else {})
    if isinstance(out.get("betas"), list):
        out["betas"] = tuple(out["betas"])
    return out


def _optim_file_contents(
    reader: CheckpointReader,
    meta: CheckpointMeta,
    groups: list[list[str]],
    rank: int,
    ds_config: dict[str, object],
    scaler: DeepSpeedObject,
) -> dict[str, object]:
    world, stage = meta.world_size, meta.stage
    keys = sorted(k[len(OPTIM_PREFIX) :] for k in reader.kinds() if k.startswith(OPTIM_PREFIX))
    dynamic = bool(scaler.attributes.get("dynamic"))
    state: dict[int, dict[str, object]] = {}
    param_groups: list[dict[str, object]] = []
    fp32_groups: list[torch.Tensor] = []
    paddings: list[int] = []
    for g, names in enumerate(groups):
        if stage == 3:
            fp32 = _cat(_stage3_slices(reader, names, rank, world))
            tensors = {k: _cat(_stage3_slices(reader, names, rank, world, OPTIM_PREFIX + k)) for k in keys}
            fp32_groups.append(fp32)
        else:
            total = sum(reader.numel(n) for n in names)
            lo, size, padding = _stage12_bounds(total, rank, world)
            fp32 = _flat_range(reader, WEIGHT, names, lo, lo + size)
            tensors = {k: _flat_range(reader, OPTIM_PREFIX + k, names, lo, lo + size) for k in keys}
            fp32_groups.append(fp32[: size - padding])
            paddings.append(padding)
        state[g] = {**_scalars(meta, g), **tensors} if tensors else {}
        param_groups.append({**_hyper(meta, g), "params": [g]})
    base = {"state": {g: s for g, s in state.items() if s}, "param_groups": param_groups}
    common = {"loss_scaler": scaler, "dynamic_loss_scale": dynamic, "overflow": False, "zero_stage": stage}
    if stage == 3:
        return {**common, "partition_count": world, "optimizer_state_dict": base,
                "fp32_flat_groups": fp32_groups}
    clip = ds_config.get("gradient_clipping", 0.0)
    return {**common, "clip_grad": float(clip) if isinstance(clip, (int, float)) else 0.0,
            "base_optimizer_state": base, "single_partition_of_fp32_groups": fp32_groups,
            "group_paddings": paddings, "partition_count": [world] * len(groups), "ds_version": DS_VERSION}


def write_rank_files(
    tag_dir: str | os.PathLike[str],
    rank: int,
    *,
    ds_config: dict[str, object] | None = None,
    groups: list[list[str]] | None = None,
    loss_scaler: DeepSpeedObject | None = None,
) -> list[Path]:
    """Write rank ``rank``'s DeepSpeed files into ``tag_dir`` (a zerorun checkpoint of any world
    size whose files are all written -- the temporary directory of a save before its commit, or
    a committed tag; ``rank`` < its world size). Not collective: every rank calls it once.
    ``groups``: the trainable parameters' names per optimizer param group, in order (default:
    one group of every trainable parameter). ``loss_scaler``: DeepSpeed's scaler object for the
    optimizer files (`loss_scaler_object`; default: the static scale 1). Returns the files written."""
    tag_dir = Path(tag_dir)
    written: list[Path] = []
    with CheckpointReader(tag_dir) as reader:
        meta = reader.meta
        world, stage = meta.world_size, meta.stage
        trainable = [p for p in meta.params if p.requires_grad and reader.has(p.name, WEIGHT)]
        frozen = [p for p in meta.params if not p.requires_grad and reader.has(p.name, WEIGHT)]
        if groups is None:
            groups = [[p.name for p in trainable]]
        known = {p.name: p for p in trainable}
        unknown = [n for names in groups for n in names if n not in known]
        if unknown:
            raise CheckpointError(f"{tag_dir}: DeepSpeed layout: parameters {unknown[:4]} are not trained in the checkpoint")
        buffers = OrderedDict(
            (b.name, reader.read_full(b.name, BUFFER).reshape(b.shape)) for b in meta.buffers if reader.has(b.name, BUFFER)
        )
        compute = _COMPUTE.get(meta.precision, torch.float32)
        counters = meta.counters
        states: dict[str, Any] = {
            "buffer_names": list(buffers),
            "param_shapes": [OrderedDict((n, torch.Size(known[n].shape)) for n in names) for names in groups],
            "shared_params": dict(meta.tied),
            "frozen_param_shapes": OrderedDict((p.name, torch.Size(p.shape)) for p in frozen) if frozen else None,
            "frozen_param_fragments": None,
            "ds_version": DS_VERSION,
            "ds_config": ds_config,
            "global_steps": counters.get("global_steps", 0),
            "global_samples": counters.get("global_samples", 0),
            "skipped_steps": counters.get("skipped_steps", 0),
            "iteration": counters.get("global_steps", 0),
            "dp_world_size": world,
            "mp_world_size": 1,
            "optimizer": None,
            "lr_scheduler": None,
            "zerorun_checkpoint": "the zerorun files in this directory hold the full resume state",
        }
        if stage == 3:
            # DeepSpeed's partitioned parameters hold empty placeholders (their state_dict()),
            # which its loader matches key for key before filling them from the optimizer files.
            module3: OrderedDict[str, torch.Tensor] = OrderedDict(
                (p.name, torch.empty(0, dtype=compute if dtype_from_name(p.dtype).is_floating_point else dtype_from_name(p.dtype)))
                for p in meta.params
            )
            for alias, canonical in meta.tied.items():
                if canonical in module3:
                    module3[alias] = module3[canonical]
            module3.update(buffers)
            states["module"] = module3
            if frozen:
                pieces = _stage3_slices(reader, [p.name for p in frozen], rank, world)
                states["frozen_param_fragments"] = OrderedDict(
                    (p.name, piece) for p, piece in zip(frozen, pieces, strict=True)
                )
            path = tag_dir / model_states_file(rank, 3)
            _save(states, path)
            written.append(path)
        elif rank == 0:
            module: OrderedDict[str, torch.Tensor] = OrderedDict()
            for p in meta.params:
                if reader.has(p.name, WEIGHT):
                    dtype = compute if dtype_from_name(p.dtype).is_floating_point else dtype_from_name(p.dtype)
                    module[p.name] = reader.read_full(p.name, WEIGHT, dtype=dtype).reshape(p.shape)
            for alias, canonical in meta.tied.items():
                if canonical in module:
                    module[alias] = module[canonical]
            module.update(buffers)
            states["module"] = module
            if frozen:
                states["frozen_param_fragments"] = OrderedDict(
                    (p.name, reader.read_full(p.name, WEIGHT, dtype=torch.float32).reshape(p.shape)) for p in frozen
                )
            path = tag_dir / model_states_file(0, stage)
            _save(states, path)
            written.append(path)
        if stage >= 1 and trainable:
            optim = {
                "optimizer_state_dict": _optim_file_contents(
                    reader, meta, groups, rank, ds_config or {}, loss_scaler or loss_scaler_object(1.0, dynamic=False)
                ),
                "ds_config": ds_config,
                "ds_version": DS_VERSION,
            }
            path = tag_dir / optim_file(rank, meta.precision)
            _save(optim, path)
            written.append(path)
    return written


def copy_recovery_script(save_dir: str | os.PathLike[str]) -> Path:
    """Put ``zero_to_fp32.py`` in ``save_dir`` as DeepSpeed does (rank 0): zerorun's script
    with DeepSpeed's command line, consolidating the zerorun files (recovery_script.py)."""
    dst = Path(save_dir) / RECOVERY_SCRIPT
    tmp = dst.with_name(f".{RECOVERY_SCRIPT}.tmp")
    shutil.copyfile(Path(__file__).with_name("recovery_script.py"), tmp)
    os.chmod(tmp, os.stat(tmp).st_mode | stat.S_IEXEC)
    os.replace(tmp, dst)
    return dst


@dataclass
class DeepSpeedOptimStates:
    """A DeepSpeed-layout checkpoint's optimizer states, whole per parameter (`read_optim_states`)."""

    stage: int
    world_size: int
    groups: list[list[str]]  # trainable parameter names per optimizer param group, in order
    param_groups: list[dict[str, object]]  # hyperparameters per group ("params" left out)
    scalars: list[dict[str, object]]  # non-elementwise state per group (Adam's "step")
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # name -> {"fp32", "exp_avg", ...}


def _rank_of(path: Path) -> int:
    return int(path.name.split("zero_pp_rank_")[1].split("_")[0])


def read_optim_states(tag_dir: str | os.PathLike[str]) -> DeepSpeedOptimStates:
    """The fp32 master weights and elementwise optimizer states of a DeepSpeed-layout tag
    directory (stages 1-3; the files above), reassembled into whole tensors in each parameter's
    shape: the inverse of `write_rank_files`, for any world size it was written at."""
    tag_dir = Path(tag_dir)
    optim_paths = sorted(tag_dir.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"), key=_rank_of)
    model_paths = sorted(tag_dir.glob("*_model_states.pt"))
    if not optim_paths or not model_paths:
        raise CheckpointError(f"{tag_dir}: no DeepSpeed optimizer and model state files (stages 1-3 write them)")
    sds = [load_file(p)["optimizer_state_dict"] for p in optim_paths]
    world, stage = len(sds), int(sds[0]["zero_stage"])
    if [_rank_of(p) for p in optim_paths] != list(range(world)):
        raise CheckpointError(f"{tag_dir}: optimizer state files of ranks {[_rank_of(p) for p in optim_paths]}")
    shapes: list[dict[str, torch.Size]] = load_file(model_paths[0])["param_shapes"]
    if stage == 3:
        base = [sd["optimizer_state_dict"] for sd in sds]
        flats = [sd["fp32_flat_groups"] for sd in sds]
    else:
        base = [sd["base_optimizer_state"] for sd in sds]
        flats = [sd["single_partition_of_fp32_groups"] for sd in sds]
    rigid = isinstance(base[0], dict)
    per_rank_states = [b["state"] if rigid else dict(enumerate(b)) for b in base]
    num_groups = len(flats[0])
    keys = sorted({k for st in per_rank_states for s in st.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0})
    scalars = [{k: v for k, v in per_rank_states[0].get(g, {}).items() if not (torch.is_tensor(v) and v.dim() > 0)}
               for g in range(num_groups)]
    hyper = [{k: v for k, v in pg.items() if k != "params"} for pg in base[0]["param_groups"]] if rigid else []
    out = DeepSpeedOptimStates(stage, world, [list(s) for s in shapes], hyper, scalars)

    def streams(g: int) -> dict[str, list[torch.Tensor]]:
        """Per kind ("fp32" + optimizer keys), each rank's piece of group g."""
        got: dict[str, list[torch.Tensor]] = {"fp32": [f[g].float() for f in flats]}
        for key in keys:
            pieces = []
            for r, st in enumerate(per_rank_states):
                t = st.get(g, {}).get(key)
                if t is None:
                    raise CheckpointError(f"{optim_paths[r]}: no {key!r} state for param group {g}")
                if stage != 3 and rigid:  # the rigid form keeps the partition's padding
                    t = t[: flats[r][g].numel()]
                pieces.append(t.float())
            got[key] = pieces
        return got

    if stage == 3:  # each rank: ceil(numel / world) of every parameter, groups one after another
        names = [(n, shape) for group in shapes for n, shape in group.items()]
        per_kind: dict[str, list[list[torch.Tensor]]] = {}
        for g in range(num_groups):
            for kind, pieces in streams(g).items():
                ranks = per_kind.setdefault(kind, [[] for _ in range(world)])
                for r, t in enumerate(pieces):
                    ranks[r].append(t)
        for kind, per_rank in per_kind.items():
            rank_flats = [torch.cat(ts) for ts in per_rank]
            offset = 0
            for name, shape in names:
                chunk = math.ceil(shape.numel() / world)
                whole = torch.cat([f[offset : offset + chunk] for f in rank_flats])[: shape.numel()]
                out.tensors.setdefault(name, {})[kind] = whole.view(shape)
                offset += chunk
    else:  # each group: the ranks' partitions one after another, parameters in order
        if len(shapes) != num_groups:
            raise CheckpointError(f"{tag_dir}: {len(shapes)} param_shapes groups for {num_groups} optimizer groups")
        for g, group in enumerate(shapes):
            for kind, pieces in streams(g).items():
                flat = torch.cat(pieces)
                offset = 0
                for name, shape in group.items():
                    if offset + shape.numel() > flat.numel():
                        raise CheckpointError(f"{tag_dir}: group {g} holds {flat.numel()} elements, fewer than its shapes")
                    out.tensors.setdefault(name, {})[kind] = flat[offset : offset + shape.numel()].view(shape)
                    offset += shape.numel()
    return out


def read_fp32_state_dict(tag_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The whole model in fp32 from a DeepSpeed-layout tag directory alone (no zerorun files: a
    checkpoint DeepSpeed itself wrote, say): trainable parameters from the optimizer files
    (stages 1-3) or ``module`` (stage 0), frozen parameters from their fragments, buffers from
    ``module``, tied aliases from ``shared_params`` -- what DeepSpeed's ``zero_to_fp32.py`` gives."""
    tag_dir = Path(tag_dir)
    model_paths = sorted(tag_dir.glob("*_model_states.pt"))
    if not model_paths:
        raise CheckpointError(f"{tag_dir}: no DeepSpeed model states file (*_model_states.pt)")
    model = load_file(model_paths[0])
    out: dict[str, torch.Tensor] = {
        k: v.float() for k, v in model["module"].items() if k in set(model.get("buffer_names") or [])
    }
    if any(tag_dir.glob("*zero_pp_rank_*_optim_states.pt")):
        states = read_optim_states(tag_dir)
        out.update({name: kinds["fp32"] for name, kinds in states.tensors.items()})
        stage = states.stage
    else:  # stage 0: the module holds every parameter
        out.update({k: v.float() for k, v in model["module"].items()})
        stage = 0
    frozen_shapes = model.get("frozen_param_shapes") or {}
    if frozen_shapes and stage == 3:
        ranks = [load_file(p)["frozen_param_fragments"] for p in sorted(model_paths, key=_rank_of)]
        for name, shape in frozen_shapes.items():
            whole = torch.cat([r[name].float() for r in ranks])[: shape.numel()]
            out[name] = whole.view(shape)
    elif frozen_shapes:
        out.update({k: v.float().view(frozen_shapes[k]) for k, v in (model.get("frozen_param_fragments") or {}).items()})
    for alias, name in (model.get("shared_params") or {}).items():
        if name in out:
            out[alias] = out[name]
    return out
