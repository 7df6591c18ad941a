"""Reading and writing whole parameters of a partitioned model.

* ``GatheredParameters(params, modifier_rank=None)`` -- full parameters for the duration of a
  ``with`` block; with ``modifier_rank=r`` what rank ``r`` wrote is broadcast and cut back into
  every rank's shards (and fp32 master shards) on exit. Collective.
* ``module.state_dict()`` at stage 3 returns *full* tensors (compute dtype, on the CPU), the
  same on every rank. Collective: every rank must call it (one all-reduce per partitioned
  parameter, one parameter in memory at a time); for big models prefer
  ``engine.save_16bit_model`` / checkpoints, which stream.
* ``module.load_state_dict(sd)`` at stage 3 (or after ``zero.Init``) copies each rank's slice
  of every partitioned parameter out of ``sd`` (which every rank holds) into its shards and its
  fp32 masters; nothing is gathered. ``load_pretrained(module, path)`` does the same from
  safetensors files, reading only this rank's rows of each tensor.

A parameter is *partitioned by stage 3* when it has ``_zerorun_group`` (a ParamGroup) and
*partitioned by zero.Init* (before ``initialize``) when it has ``_zerorun_init`` (an InitShard).
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerorun.errors import RuntimeConfigError
from zerorun.runtime.flat_stage import wait_all_params
from zerorun.runtime.stage3.param_group import ParamGroup

if TYPE_CHECKING:
    from torch.nn.modules.module import _IncompatibleKeys

    from zerorun.runtime.stage3.zero_init import InitShard

__all__ = ["GatheredParameters", "install_state_dict_hooks", "load_pretrained", "is_partitioned", "set_full_state_dict"]


def _group(p: nn.Parameter) -> ParamGroup | None:
    return getattr(p, "_zerorun_group", None)


def _init(p: nn.Parameter) -> InitShard | None:
    return getattr(p, "_zerorun_init", None)


def is_partitioned(p: nn.Parameter) -> bool:
    g = _group(p)
    return _init(p) is not None or (g is not None and not g.resident)


def _world_group() -> tuple[int, dist.ProcessGroup | None]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), None
    return 1, None


# -- writing a parameter's values into whatever holds them ----------------------------------------
def write_param(p: nn.Parameter, values: torch.Tensor) -> None:
    """``values`` = the full parameter (every rank has it). No communication."""
    flat = values.detach().reshape(-1)
    g = _group(p)
    if g is not None:
        li, si = g.find(p)
        layout = g.layouts[li]
        slot = layout.slots[si]
        if flat.numel() != slot.numel:
            raise RuntimeConfigError(f"{slot.name}: {flat.numel()} values given, the parameter has {slot.numel}")
        write_group_range(g, li, slot.offset, slot.offset + slot.numel, flat.to(g.device))
        return
    h = _init(p)
    if h is not None:
        h.write_full(flat.to(h.shard.device))
        return
    with torch.no_grad():
        p.data.copy_(flat.view(p.shape))


def write_group_range(g: ParamGroup, li: int, lo: int, hi: int, values: torch.Tensor) -> None:
    """``values`` are elements ``[lo, hi)`` of flat buffer ``li`` of ``g``: update this rank's
    at-rest shard, its fp32 master and, if the group is gathered, the gathered buffer."""
    layout = g.layouts[li]
    _settle(g, li)
    start, end = layout.shard_range(g.rank)
    a, b = max(lo, start), min(hi, end)
    with torch.no_grad():
        if g.state != 0 or g.resident:  # gathered: keep the live copy in step
            g.full[li][lo:hi].copy_(values)
        if a < b:
            piece = values[a - lo : b - lo]
            g.at_rest[li][a - start : b - start].copy_(piece)
            master = _master(g, li)
            if master is not None and master.data_ptr() != g.at_rest[li].data_ptr():
                master[a - start : b - start].copy_(piece.to(master.dtype))


def _settle(g: ParamGroup, li: int) -> None:
    """The at-rest shard's pending optimizer write-back (CPU offload, step started in the
    backward: ``ParamGroup.settle``) done before it is read or written here."""
    g.settle(li)


def _master(g: ParamGroup, li: int) -> torch.Tensor | None:
    stage = getattr(g, "stage", None)
    if stage is None:
        return None
    return stage.state.masters[g.layouts[li].index]


# -- GatheredParameters ------------------------------------------------------------------------------
class GatheredParameters:
    """DeepSpeed's ``zero.GatheredParameters``; see the module docstring."""

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter] | None,
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        if params is None:
            params = []
        elif isinstance(params, torch.Tensor):
            params = [params]  # type: ignore[list-item]
        self.params = [p for p in params if p is not None]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        seen: set[int] = set()
        self.groups: list[ParamGroup] = []
        for p in self.params:
            g = _group(p)
            if g is not None and id(g) not in seen:
                seen.add(id(g))
                self.groups.append(g)
        self.groups.sort(key=lambda g: g.index)  # same collective order on every rank
        # Callers may pass a set (transformers does): order by partition order, not theirs.
        self.inits = sorted((p for p in self.params if _init(p) is not None), key=operator.attrgetter("ds_id"))
        self.plain = [p for p in self.params if _group(p) is None and _init(p) is None]

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        if self.plain:  # parameters of stages 0-2: their last step's all-gather may be in flight
            wait_all_params()
        # Groups already gathered (inside their forward, or kept) stay as they were on exit.
        self._was_gathered = {id(g) for g in self.groups if g.state != 0}
        for g in self.groups:
            g.holds += 1
            g.wait()
        for p in self.inits:
            h = _init(p)
            assert h is not None  # self.inits: zero.Init parameters only
            p.data = h.materialize().clone().view(h.shape)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        world, _ = _world_group()
        src = self.modifier_rank
        try:
            if src is not None and exc[0] is None:
                with torch.no_grad():
                    self._scatter_back(src, world)
        finally:
            for g in self.groups:
                g.holds -= 1
                if g.holds == 0 and id(g) not in self._was_gathered:
                    g.release()
            for p in self.inits:
                h = _init(p)
                assert h is not None
                p.data = h.placeholder

    def _scatter_back(self, src: int, world: int) -> None:
        mine = {id(p) for p in self.params}
        for g in self.groups:
            for li, full in enumerate(g.full):
                if world > 1:
                    _broadcast(full, src)
                first = sum(len(x.slots) for x in g.layouts[:li])
                for k, slot in enumerate(g.layouts[li].slots):
                    if id(g._flat_params[first + k]) in mine:
                        values = full[slot.offset : slot.offset + slot.numel].clone()
                        write_group_range(g, li, slot.offset, slot.offset + slot.numel, values)
        for p in self.inits:
            if world > 1:
                _broadcast(p.data, src)
            h = _init(p)
            assert h is not None
            h.write_full(p.data)
        for p in self.plain:
            if world > 1:
                _broadcast(p.data, src)


def _broadcast(t: torch.Tensor, src: int) -> None:
    # gloo carrying CUDA tensors (several ranks sharing a GPU) is staged through the host.
    if t.is_cuda and dist.get_backend() == "gloo":
        host = t.cpu()
        dist.broadcast(host, src=src)
        t.copy_(host)
    else:
        dist.broadcast(t, src=src)


# -- state_dict / load_state_dict hooks ---------------------------------------------------------------
def _assemble(p: nn.Parameter) -> torch.Tensor:
    """Full values of a partitioned parameter on every rank (collective), on the CPU."""
    h = _init(p)
    if h is not None:
        return h.materialize().view(h.shape).cpu().clone()
    g = _group(p)
    assert g is not None
    li, si = g.find(p)
    layout, slot = g.layouts[li], g.layouts[li].slots[si]
    _settle(g, li)  # (a resident group's full buffer is its at-rest shard at one rank)
    if g.state != 0:
        return g.full[li][slot.offset : slot.offset + slot.numel].view(slot.shape).cpu().clone()
    out = torch.zeros(slot.numel, dtype=g.dtype, device=g.device)
    start, end = layout.shard_range(g.rank)
    a, b = max(slot.offset, start), min(slot.offset + slot.numel, end)
    if a < b:
        out[a - slot.offset : b - slot.offset].copy_(g.at_rest[li][a - start : b - start])
    if g.world > 1:
        g.comm.all_reduce_now(out)  # each element is owned by exactly one rank: the sum is a copy
    return out.view(slot.shape).cpu()


# DeepSpeed's `module.state_dict()` at stage 3 holds the placeholders, not the values, and code
# written for it relies on that (transformers' from_pretrained calls it on every rank for the
# keys alone). zerorun's DeepSpeed compatibility layer turns assembling off (Contract 8).
_assemble_on_state_dict = True


def set_full_state_dict(full: bool) -> bool:
    """Whether ``state_dict()`` assembles partitioned parameters; returns the previous value."""
    global _assemble_on_state_dict
    previous, _assemble_on_state_dict = _assemble_on_state_dict, full
    return previous


def _state_dict_post_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, _meta: object) -> None:
    if not _assemble_on_state_dict:
        return
    for name, p in module._parameters.items():
        if p is None or not is_partitioned(p):
            continue
        key = prefix + name
        # keep_vars=True asks for the Parameter objects themselves (their attributes matter).
        if key in state_dict and state_dict[key] is not p:
            state_dict[key] = _assemble(p)


class _LoadHooks:
    def __init__(self) -> None:
        self.loaded: set[str] = set()

    def pre(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        _meta: object,
        _strict: bool,
        _missing: list[str],
        _unexpected: list[str],
        error_msgs: list[str],
    ) -> None:
        for name, p in module._parameters.items():
            # Every stage-3 parameter, replicated ones too: their fp32 masters must follow.
            if p is None or (_group(p) is None and _init(p) is None):
                continue
            key = prefix + name
            if key not in state_dict:
                continue
            h = _init(p)
            if h is not None and p.data.data_ptr() != h.placeholder.data_ptr():
                # Gathered by GatheredParameters: torch copies into the full tensor, which the
                # block's exit keeps (modifier_rank) -- writing the shard here would be undone.
                continue
            value = state_dict.pop(key)
            shape = tuple(getattr(p, "ds_shape", p.shape))
            if tuple(value.shape) != shape:
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from checkpoint, "
                    f"the shape in current model is {shape}."
                )
                continue
            write_param(p, value)
            self.loaded.add(key)

    def post(self, _module: nn.Module, incompatible: _IncompatibleKeys) -> None:
        if self.loaded:
            incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in self.loaded]


def install_state_dict_hooks(root: nn.Module) -> list[RemovableHandle]:
    """Make ``state_dict`` / ``load_state_dict`` of ``root`` and its submodules stage-3 aware."""
    handles = []
    for m in root.modules():
        if getattr(m, "_zerorun_io_hooks", False):
            continue
        m._zerorun_io_hooks = True  # type: ignore[assignment]  # a flag, not a tensor or module
        handles.append(m.register_state_dict_post_hook(_state_dict_post_hook))
        hooks = _LoadHooks()
        handles.append(m.register_load_state_dict_pre_hook(hooks.pre))
        handles.append(m.register_load_state_dict_post_hook(hooks.post))
    return handles


# -- pretrained weights from safetensors ------------------------------------------------------------
def _files(source: str | Path) -> list[Path]:
    path = Path(source)
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.exists():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [path / n for n in names]
        found = sorted(path.glob("*.safetensors"))
        if not found:
            raise RuntimeConfigError(f"{path}: no *.safetensors files in this directory")
        return found
    if not path.exists():
        raise RuntimeConfigError(f"{path}: no such file")
    return [path]


def _own_ranges(p: nn.Parameter) -> list[tuple[int, int]]:
    """Element ranges of the flattened parameter this rank stores (empty: none; None-like for
    replicated parameters is the full range)."""
    h = _init(p)
    if h is not None:
        lo, hi = h.own_range
        return [(lo, hi)] if lo < hi else []
    g = _group(p)
    if g is None or g.resident:
        return [(0, p.numel())]
    li, si = g.find(p)
    layout, slot = g.layouts[li], g.layouts[li].slots[si]
    start, end = layout.shard_range(g.rank)
    a, b = max(slot.offset, start), min(slot.offset + slot.numel, end)
    return [(a - slot.offset, b - slot.offset)] if a < b else []


def _read_range(sl: Any, shape: list[int], lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of the flattened tensor, reading only the rows that hold them."""
    if len(shape) <= 1:
        return sl[lo:hi].reshape(-1)
    row = math.prod(shape[1:])
    r0, r1 = lo // row, -(-hi // row)
    rows = sl[r0:r1].reshape(-1)
    return rows[lo - r0 * row : hi - r0 * row]


def load_pretrained(module: nn.Module, source: str | Path | Mapping[str, torch.Tensor], *, strict: bool = True) -> list[str]:
    """Load weights into a (partitioned or not) model, each rank reading only its slices.
    ``source``: a state dict, a ``.safetensors`` file, or a directory of them (Hugging Face
    shards with ``model.safetensors.index.json``). Returns the missing keys (``strict`` raises)."""
    if isinstance(source, Mapping):
        result = module.load_state_dict(dict(source), strict=strict)
        return list(result.missing_keys)
    from safetensors import safe_open

    wanted: dict[str, nn.Parameter | torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    wanted.update(dict(module.named_buffers()))
    done: set[str] = set()
    by_id: dict[int, list[str]] = {}
    for name, tensor in wanted.items():
        by_id.setdefault(id(tensor), []).append(name)
    for path in _files(source):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                t = wanted.get(key)
                if t is None or key in done:
                    continue
                sl = f.get_slice(key)
                shape = list(sl.get_shape())
                expected = list(getattr(t, "ds_shape", t.shape))
                if shape != expected:
                    raise RuntimeConfigError(f"{path}: {key} has shape {shape}, the model's parameter {expected}")
                with torch.no_grad():
                    if isinstance(t, nn.Parameter) and is_partitioned(t):
                        for lo, hi in _own_ranges(t):
                            _write_piece(t, lo, hi, _read_range(sl, shape, lo, hi))
                    else:
                        write_param(t, f.get_tensor(key)) if isinstance(t, nn.Parameter) else t.copy_(f.get_tensor(key))
                done.update(by_id[id(t)])
    missing = [n for n in wanted if n not in done]
    if strict and missing:
        raise RuntimeConfigError(
            f"load_pretrained: {len(missing)} parameter(s)/buffer(s) not found in {source} (first: {missing[:5]}); "
            "pass strict=False to keep their current values"
        )
    return missing


def _write_piece(p: nn.Parameter, lo: int, hi: int, values: torch.Tensor) -> None:
    h = _init(p)
    if h is not None:
        h.write_range(lo, hi, values.to(h.shard.device))
        return
    g = _group(p)
    assert g is not None
    li, si = g.find(p)
    slot = g.layouts[li].slots[si]
    write_group_range(g, li, slot.offset + lo, slot.offset + hi, values.to(g.device))
