"""The engine's side of checkpoints: `CheckpointView` over an `Engine`, and the three calls
`Engine.save_checkpoint` / `load_checkpoint` / `save_16bit_model` delegate to.

What it reads of the runtime (Contract 6): the ``Stage`` protocol of ``engine.stage`` -- its
``state`` (the `ShardedOptimizerState`: ``layouts``, ``shard_index``, ``masters``,
``optimizer``, ``load_sharded_state``) and, after a load, ``params_from_masters()`` (the stage
re-derives the parameters the forward uses) -- the flat layouts' ``pieces_in_range``
(partition.py), ``engine.comm`` (rank, world size, group), the module, scheduler, loss scaler
and counters.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from .export import save_full_model
from .format import BUFFER, OPTIM_PREFIX, WEIGHT, CheckpointMeta, Fragment, ParamInfo, dtype_name
from .sharded import load_checkpoint as _load
from .sharded import save_checkpoint as _save

if TYPE_CHECKING:
    from zerorun.runtime.engine import Engine

__all__ = ["EngineCheckpointView", "save", "load", "save_16bit_model"]

log = logging.getLogger("zerorun.checkpoint")

DATA_POSITION_KEY = "data_position"  # in the metadata's `extra`


def _jsonable(value: Any) -> Any:
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    return repr(value)


def _persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers that ``state_dict()`` holds, each once, without calling ``state_dict()`` (which
    at stage 3 would have to gather parameters)."""
    seen: set[int] = set()
    out: list[tuple[str, torch.Tensor]] = []
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for name, b in mod._buffers.items():
            if b is None or name in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            out.append((f"{mod_name}.{name}" if mod_name else name, b))
    return out


class EngineCheckpointView:
    """`CheckpointView` (sharded.py) over an `Engine`."""

    def __init__(self, engine: Engine, *, exclude_frozen: bool = False) -> None:
        self.engine = engine
        self.exclude_frozen = exclude_frozen  # DeepSpeed's exclude_frozen_parameters
        self.rank: int = engine.comm.rank
        self.world_size: int = engine.comm.world_size
        self.process_group = engine.comm.group
        self.device = engine.device
        self.state = engine.stage.state  # ShardedOptimizerState
        self._optim_targets: dict[tuple[int, str], torch.Tensor] = {}

    # -- description --------------------------------------------------------------------------
    def _named_params(self) -> tuple[list[tuple[str, nn.Parameter]], dict[str, str]]:
        first: dict[int, str] = {}
        params: list[tuple[str, nn.Parameter]] = []
        tied: dict[str, str] = {}
        for name, p in self.engine.module.named_parameters(remove_duplicate=False):
            if id(p) in first:
                tied[name] = first[id(p)]
                continue
            first[id(p)] = name
            params.append((name, p))
        return params, tied

    def _trained_names(self) -> set[str]:
        return {slot.name for layout in self.state.layouts for slot in layout.slots}

    def _trained_shapes(self) -> dict[str, tuple[int, ...]]:
        # from the layouts: at stage 3 a released parameter's own shape is an empty placeholder
        return {slot.name: tuple(slot.shape) for layout in self.state.layouts for slot in layout.slots}

    def checkpoint_meta(self) -> CheckpointMeta:
        e = self.engine
        params, tied = self._named_params()
        trained = self._trained_shapes()
        policy = e.settings.precision.policy
        infos = [
            ParamInfo(
                n,
                trained.get(n, tuple(p.shape)),
                dtype_name(policy.param_dtype if n in trained else p.dtype),
                n in trained,
            )
            for n, p in params
            if not (self.exclude_frozen and n not in trained)
        ]
        buffers = [ParamInfo(n, tuple(b.shape), dtype_name(b.dtype), False) for n, b in _persistent_buffers(e.module)]
        precision = "fp16" if e.settings.precision.fp16 else ("bf16" if policy.param_dtype == torch.bfloat16 else "fp32")
        opt = e.optimizer
        return CheckpointMeta(
            world_size=self.world_size,
            stage=int(e.settings.stage),
            precision=precision,
            params=infos,
            buffers=buffers,
            tied=tied,
            optimizer={
                "class": type(opt).__name__,
                "param_groups": [_jsonable({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups],
                "scalar_state": _jsonable(self._scalar_state()),
            },
            counters={
                "global_steps": int(e.global_steps),
                "global_samples": int(e.global_samples),
                "micro_steps": int(e.micro_steps),
                "skipped_steps": int(e.skipped_steps),
            },
            extra=self._data_position(),
        )

    def _data_position(self) -> dict[str, Any]:
        # The engine's own data loader (initialize(training_data=...)): where its pass stands
        # (checkpoint/data_position.py). A loader the script built is the script's business.
        position = getattr(getattr(self.engine, "training_dataloader", None), "position", None)
        return {DATA_POSITION_KEY: position(self.world_size)} if position is not None else {}

    def _optimizer(self) -> Optimizer:
        opt = self.state.optimizer
        if opt is None:  # initialize attaches it before the engine exists
            raise RuntimeError("checkpoint of a stage whose optimizer state has no optimizer attached")
        return opt

    def _scalar_state(self) -> list[dict[str, Any]]:
        """Per param group, the optimizer's non-elementwise state (Adam's ``step``), taken from
        the group's first master that has state (all masters of a group step together)."""
        opt = self._optimizer()
        out: list[dict[str, Any]] = []
        for group in opt.param_groups:
            scalars: dict[str, Any] = {}
            for p in group["params"]:
                s = opt.state.get(p)
                if s:
                    scalars = {k: v for k, v in s.items() if not (torch.is_tensor(v) and v.dim() > 0)}
                    break
            out.append(scalars)
        return out

    # -- fragments ----------------------------------------------------------------------------
    def checkpoint_fragments(self, *, for_load: bool, kinds: set[str] | None = None) -> list[Fragment]:
        st = self.state
        opt = self._optimizer()
        frags: list[Fragment] = []
        self._optim_targets = {}
        for i, (layout, master) in enumerate(zip(st.layouts, st.masters, strict=True)):
            lo, hi = layout.shard_range(st.shard_index)
            replicated = layout.num_shards == 1 and self.world_size > 1
            sources: dict[str, torch.Tensor] = {WEIGHT: master}
            if for_load:
                # Targets: the optimizer's own state tensors where they exist (read in place: no
                # second copy, and NVMe offload's memory-mapped files stay what they are), fresh
                # zeros where no step created them yet. `restore_checkpoint_state` then hands
                # them to the optimizer through its load_state_dict (same dtype and device: kept
                # as they are, not copied).
                current = opt.state.get(master, {})
                for kind in sorted(kinds or ()):
                    if kind.startswith(OPTIM_PREFIX):
                        key = kind[len(OPTIM_PREFIX) :]
                        t = current.get(key)
                        if not (torch.is_tensor(t) and t.shape == master.shape and t.dtype == master.dtype):
                            t = torch.zeros_like(master)
                        self._optim_targets[(i, key)] = t
                        sources[kind] = t
            else:
                for key, v in opt.state.get(master, {}).items():
                    if torch.is_tensor(v) and v.dim() > 0 and v.numel() == master.numel():
                        sources[OPTIM_PREFIX + key] = v
            for slot, a, b in layout.pieces_in_range(lo, hi):
                off = slot.offset + a - lo
                for kind, src in sources.items():
                    frags.append(Fragment(slot.name, kind, a, b, src[off : off + b - a], replicated))
        # Parameters the optimizer does not train (frozen, or not in its groups) and buffers:
        # every rank holds them whole.
        trained = self._trained_names()
        for name, p in self._named_params()[0]:
            if name not in trained and not self.exclude_frozen:
                frags.append(Fragment(name, WEIGHT, 0, p.numel(), p.data, replicated=True))
        for name, buf in _persistent_buffers(self.engine.module):
            frags.append(Fragment(name, BUFFER, 0, buf.numel(), buf, replicated=True))
        return frags

    # -- small objects ------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        e = self.engine
        sched = e.lr_scheduler
        return {
            "lr_scheduler": sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None,
            "loss_scaler": e.loss_scaler.state_dict(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in e.optimizer.param_groups],
            "scalar_state": self._scalar_state(),
        }

    def restore_checkpoint_state(
        self, state: dict[str, Any], meta: CheckpointMeta, *, optimizer: bool, scheduler: bool, module_only: bool
    ) -> None:
        e = self.engine
        if optimizer:
            self._restore_optimizer(state, meta)
        if module_only:
            return
        e.global_steps = meta.counters.get("global_steps", 0)
        e.global_samples = meta.counters.get("global_samples", 0)
        e.micro_steps = meta.counters.get("micro_steps", 0)
        e.skipped_steps = meta.counters.get("skipped_steps", 0)
        resume_at = getattr(getattr(e, "training_dataloader", None), "resume_at", None)
        if resume_at is not None and DATA_POSITION_KEY in meta.extra:
            resume_at(meta.extra[DATA_POSITION_KEY], self.world_size)
        if state.get("loss_scaler") is not None:
            e.loss_scaler.load_state_dict(state["loss_scaler"])
        if scheduler and e.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            e.lr_scheduler.load_state_dict(state["lr_scheduler"])

    def _restore_optimizer(self, state: dict[str, Any], meta: CheckpointMeta) -> None:
        from zerorun.errors import CheckpointError

        st = self.state
        groups = state.get("param_groups") or []
        engine_groups = self._optimizer().param_groups
        if len(groups) != len(engine_groups):
            raise CheckpointError(
                f"checkpoint has {len(groups)} optimizer param group(s), the engine {len(engine_groups)}; "
                "pass load_optimizer_states=False"
            )
        scalars = state.get("scalar_state") or [{} for _ in groups]
        per_master: list[dict[str, Any]] = []
        for i, layout in enumerate(st.layouts):
            s: dict[str, Any] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars[layout.group].items()}
            s.update({key: t for (j, key), t in self._optim_targets.items() if j == i})
            per_master.append(s if len(s) > len(scalars[layout.group]) else {})
        st.load_sharded_state({"masters": st.masters, "optimizer_state": per_master, "param_groups": groups})
        self._optim_targets = {}

    def after_checkpoint_load(self) -> None:
        self.engine.stage.params_from_masters()


def save(
    engine: Engine,
    save_dir: str | os.PathLike[str],
    tag: str | None,
    client_state: dict[str, Any] | None,
    save_latest: bool,
    exclude_frozen_parameters: bool = False,
    before_commit: Callable[[Path, int], None] | None = None,
) -> Path:
    view = EngineCheckpointView(engine, exclude_frozen=exclude_frozen_parameters)
    return _save(view, save_dir, tag, client_state, save_latest, before_commit=before_commit)


def load(engine: Engine, load_dir: str | os.PathLike[str], tag: str | None, **flags: bool) -> tuple[str | None, dict[str, Any] | None]:
    return _load(EngineCheckpointView(engine), load_dir, tag, **flags)


def save_16bit_model(
    engine: Engine, save_dir: str | os.PathLike[str], save_filename: str, exclude_frozen_parameters: bool = False
) -> bool:
    """DeepSpeed's semantics: at stage 3 only with stage3_gather_16bit_weights_on_model_save."""
    settings = engine.settings
    if settings.stage == 3 and not settings.checkpoint.gather_16bit_weights_on_model_save:
        log.warning(
            "zerorun: save_16bit_model did not save the model: at ZeRO stage 3 it needs "
            "zero_optimization.stage3_gather_16bit_weights_on_model_save: true (or use "
            "`zerorun consolidate` on a checkpoint)"
        )
        return False
    view = EngineCheckpointView(engine, exclude_frozen=exclude_frozen_parameters)
    save_full_model(view, save_dir, save_filename, dtype=settings.precision.policy.param_dtype)
    return True
