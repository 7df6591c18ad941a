"""A DeepSpeed-layout checkpoint read back into whole tensors: the inverse of
``deepspeed_layout.write_rank_files`` (any world size it was written at), and DeepSpeed's own
checkpoints where they follow that layout (``deepspeed.utils.zero_to_fp32`` under the layer).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerorun.errors import CheckpointError

from .deepspeed_files import load_file

__all__ = ["DeepSpeedOptimStates", "read_optim_states", "read_fp32_state_dict"]


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
