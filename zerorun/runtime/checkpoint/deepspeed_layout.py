"""DeepSpeed's checkpoint files beside zerorun's, for the tools that read them.

Under ``--deepspeed-compat`` (``deepspeed.DeepSpeedEngine.save_checkpoint``) every rank adds its
DeepSpeed files to the tag directory zerorun's save has just committed::

    SAVE_DIR/zero_to_fp32.py                                   the recovery script (rank 0)
    SAVE_DIR/global_step{N}/
        mp_rank_00_model_states.pt                             stages 0-2 (rank 0): ``module``
        zero_pp_rank_{r}_mp_rank_00_model_states.pt            stage 3 (every rank)
        [bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt     stages 1-3 (every rank)

What they hold (DeepSpeed's keys, what ``zero_to_fp32.py`` and scripts read):

* model states: ``module`` (stages 0-2: the model's ``state_dict()`` in the compute dtype, as
  DeepSpeed's engine saves it; stage 3: the buffers only, DeepSpeed's partitioned parameters
  being empty placeholders there), ``buffer_names``, ``param_shapes`` (one group: every
  trainable parameter in registration order), ``shared_params`` (tied aliases),
  ``frozen_param_shapes`` / ``frozen_param_fragments`` (frozen parameters in fp32: whole at
  stages 0-2, this rank's ``ceil(numel / world)`` slice at stage 3 -- DeepSpeed writes them only
  from stage 2 and in 16 bits; here ``zero_to_fp32.py`` gives every stage's frozen parameters, in
  fp32 like the rest), ``ds_version``, ``ds_config``, the step
  counters;
* optimizer states: ``optimizer_state_dict`` with ``zero_stage``, ``partition_count`` and this
  rank's fp32 master weights in DeepSpeed's partitioning -- ``single_partition_of_fp32_groups``
  (stages 1-2: the rank's contiguous ``1/world`` of all parameters flattened, padded to a
  multiple of ``2 x world``) or ``fp32_flat_groups`` (stage 3: the rank's ``ceil(numel / world)``
  slice of each parameter, zero-padded, concatenated).

The fp32 values are read back from zerorun's own shards (``CheckpointReader``), so they are
exactly what zerorun's consolidation gives. Not written: Adam's moments and the loss scaler in
DeepSpeed's form -- resuming, at any world size, uses zerorun's files; DeepSpeed itself cannot
resume from these. Cost: the fp32 weights once more (4 bytes per parameter over all ranks),
plus the 16-bit model in rank 0's model states at stages 0-2. Each file is written under a
temporary name and renamed.
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

from .format import BUFFER, WEIGHT, dtype_from_name
from .store import CheckpointReader

__all__ = [
    "DS_VERSION",
    "RECOVERY_SCRIPT",
    "optim_file",
    "model_states_file",
    "write_rank_files",
    "copy_recovery_script",
]

DS_VERSION = "0.16.4+zerorun"  # zerorun.compat.COMPAT_VERSION (the runtime does not import compat)
RECOVERY_SCRIPT = "zero_to_fp32.py"
_COMPUTE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def optim_file(rank: int, precision: str) -> str:
    return f"{'bf16_' if precision == 'bf16' else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def model_states_file(rank: int, stage: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"


def _save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _stage12_partition(reader: CheckpointReader, names: list[str], rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous share of every trainable parameter flattened in order."""
    total = sum(reader.numel(n) for n in names)
    padded = math.ceil(total / (2 * world)) * 2 * world
    size = padded // world
    lo, hi = rank * size, (rank + 1) * size
    out = torch.zeros(size, dtype=torch.float32)
    offset = 0
    for name in names:
        n = reader.numel(name)
        s, e = max(lo, offset), min(hi, offset + n)
        if s < e:
            reader.read_into(name, WEIGHT, s - offset, e - offset, out[s - lo : e - lo])
        offset += n
    return out


def _stage3_slices(
    reader: CheckpointReader, names: list[str], rank: int, world: int, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """Rank ``rank``'s ``ceil(numel / world)`` slice of each parameter, zero-padded."""
    out = []
    for name in names:
        n = reader.numel(name)
        chunk = math.ceil(n / world)
        piece = torch.zeros(chunk, dtype=dtype or torch.float32)
        s, e = min(rank * chunk, n), min((rank + 1) * chunk, n)
        if s < e:
            reader.read_into(name, WEIGHT, s, e, piece[: e - s])
        out.append(piece)
    return out


def write_rank_files(
    tag_dir: str | os.PathLike[str], rank: int, *, ds_config: dict[str, Any] | None = None
) -> list[Path]:
    """Write rank ``rank``'s DeepSpeed files into ``tag_dir`` (a committed zerorun checkpoint
    of any world size; ``rank`` < its world size). Not collective: every rank calls it once the
    save has committed; returns the files written."""
    tag_dir = Path(tag_dir)
    written: list[Path] = []
    with CheckpointReader(tag_dir) as reader:
        meta = reader.meta
        world, stage = meta.world_size, meta.stage
        trainable = [p for p in meta.params if p.requires_grad and reader.has(p.name, WEIGHT)]
        frozen = [p for p in meta.params if not p.requires_grad and reader.has(p.name, WEIGHT)]
        names = [p.name for p in trainable]
        buffers = OrderedDict(
            (b.name, reader.read_full(b.name, BUFFER).reshape(b.shape)) for b in meta.buffers if reader.has(b.name, BUFFER)
        )
        compute = _COMPUTE.get(meta.precision, torch.float32)
        counters = meta.counters
        states: dict[str, Any] = {
            "buffer_names": list(buffers),
            "param_shapes": [OrderedDict((p.name, torch.Size(p.shape)) for p in trainable)],
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
            "zerorun_checkpoint": "the zerorun files in this directory hold the optimizer and resume state",
        }
        if stage == 3:
            states["module"] = buffers
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
        if stage >= 1 and names:
            if stage == 3:
                groups_key, flat = "fp32_flat_groups", torch.cat(_stage3_slices(reader, names, rank, world))
                partition_count: Any = world
            else:
                groups_key, flat = "single_partition_of_fp32_groups", _stage12_partition(reader, names, rank, world)
                partition_count = [world]
            optim = {
                "optimizer_state_dict": {
                    "zero_stage": stage,
                    "partition_count": partition_count,
                    groups_key: [flat],
                    "loss_scaler": None,
                    "overflow": False,
                },
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
