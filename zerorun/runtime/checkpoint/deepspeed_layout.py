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
(scripts/deepspeed_resume_check.py). ``deepspeed_read`` reads them back into whole
per-parameter tensors; ``deepspeed_files`` writes and reads the files (DeepSpeed's pickled objects).

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
import shutil
import stat
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from zerorun.errors import CheckpointError

from .deepspeed_files import DeepSpeedObject, loss_scaler_object, save_file
from .format import BUFFER, OPTIM_PREFIX, WEIGHT, CheckpointMeta, dtype_from_name
from .store import CheckpointReader

__all__ = ["DS_VERSION", "RECOVERY_SCRIPT", "optim_file", "model_states_file", "write_rank_files", "copy_recovery_script"]

DS_VERSION = "0.16.4+zerorun"  # zerorun.compat.COMPAT_VERSION (the runtime does not import compat)
RECOVERY_SCRIPT = "zero_to_fp32.py"
_COMPUTE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def optim_file(rank: int, precision: str) -> str:
    return f"{'bf16_' if precision == 'bf16' else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def model_states_file(rank: int, stage: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"


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
            save_file(states, path)
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
            save_file(states, path)
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
            save_file(optim, path)
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
