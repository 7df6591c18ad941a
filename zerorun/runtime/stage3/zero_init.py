"""``zerorun.zero.Init``: partition parameters while the model is being constructed.

Inside the context every ``nn.Module`` subclass's ``__init__`` is wrapped: when the *outermost*
``__init__`` of a module object returns (subclasses calling ``super().__init__`` count once),
the parameters of that module not yet partitioned are cut: each rank keeps the contiguous
``ceil(numel / world)`` slice of the flattened values it owns (the "init shard", in the dtype
the parameter was created in -- or in ``Init(dtype=...)``'s for floating parameters, as
DeepSpeed's -- on the training device) and the parameter's ``.data`` becomes the
placeholder: right shape, every element one shared NaN, so in-place writes raise and reads are
NaN (``p.ds_shape`` / ``p.ds_numel`` as in DeepSpeed). Peak memory is one module's own
parameters, never the model. (After ``initialize`` a released parameter is stage 3's empty
``[0]`` placeholder instead, see param_group.py.)

**Initialization is identical to normal construction with the same seed**: each module's
parameters are created and initialized exactly as without the context (same RNG draws in the
same order), then cut. Code that initializes parameters *after* their module was built sees
placeholders, so inside the context:

* ``module.apply(fn)`` gathers each module's own parameters around ``fn(module)`` and cuts
  the result again (HF-style ``_init_weights``);
* ``torch.nn.init.*_(param)`` on a partitioned parameter does the same;
* anything else (``model.layer.weight.data.normal_()`` from a parent's ``__init__``) must be
  wrapped in ``zerorun.zero.GatheredParameters(params, modifier_rank=0)``.

All ranks must construct the same model with the same seed (as without the context). When
``zerorun.initialize`` builds stage 3 it re-cuts these shards into the group layout, gathering
one parameter at a time.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable

import torch
from torch import nn

from zerorun.runtime.collectives import Communicator
from zerorun.runtime.stage3.model_io import install_state_dict_hooks

__all__ = ["InitShard", "InitContext", "partition_module", "materialize_all"]

_INIT_FUNCS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


# DeepSpeed's ``ds_id``: partition order, the same on every rank (all ranks construct the same
# modules in the same order), so collectives over a set of parameters can be ordered by it.
_PARTITION_ORDER = itertools.count()


class InitShard:
    """This rank's slice of one parameter partitioned by ``zero.Init``."""

    def __init__(
        self,
        p: nn.Parameter,
        comm: Communicator,
        store_device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        flat = p.detach().reshape(-1)
        self.comm = comm  # collectives run on the training device (NCCL cannot gather host tensors)
        store = comm.device if store_device is None else store_device
        self.shape = torch.Size(p.shape)
        self.dtype = dtype if dtype is not None and p.dtype.is_floating_point else p.dtype
        # Where the parameter was created (the CPU for a model built as usual): init code run
        # on it later (``nn.init.*_``, ``module.apply``) gets its full values *there*, so it draws
        # from that device's generator -- as without the context. (On the training GPU it would
        # draw from the CUDA generator: other values than normal construction, seen on an H200.)
        self.home = p.device
        self.numel = flat.numel()
        self.shard_numel = max(1, math.ceil(self.numel / comm.world_size))
        start = comm.rank * self.shard_numel
        self.shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=store)
        piece = flat[start : start + self.shard_numel]
        self.shard[: piece.numel()].copy_(piece)
        # Until initialize: a placeholder of the right shape (init code branches on p.dim() and
        # p.shape) that cannot be written (every element aliases one NaN: in-place writes raise)
        # and reads as NaN, never as plausible values.
        fill = float("nan") if self.dtype.is_floating_point else 0
        self.placeholder = torch.full((1,), fill, dtype=self.dtype, device=comm.device).expand(self.shape)
        p.data = self.placeholder
        p.ds_shape = self.shape  # type: ignore[attr-defined]
        p.ds_numel = self.numel  # type: ignore[attr-defined]
        p.ds_id = next(_PARTITION_ORDER)  # type: ignore[attr-defined]
        p._zerorun_init = self  # type: ignore[attr-defined]

    @property
    def own_range(self) -> tuple[int, int]:
        start = self.comm.rank * self.shard_numel
        return min(start, self.numel), min(start + self.shard_numel, self.numel)

    def materialize(self) -> torch.Tensor:
        """The full flattened values (collective: every rank, same parameters, same order)."""
        full = torch.empty(self.shard_numel * self.comm.world_size, dtype=self.dtype, device=self.comm.device)
        self.comm.all_gather(full, self.shard.to(self.comm.device)).wait()
        return full[: self.numel]

    def write_full(self, values: torch.Tensor) -> None:
        """Keep this rank's slice of ``values`` (the full parameter, any shape)."""
        lo, hi = self.own_range
        with torch.no_grad():
            self.shard[: hi - lo].copy_(values.reshape(-1)[lo:hi])

    def write_range(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """``values`` are elements ``[lo, hi)`` of the flattened parameter; keep what is ours."""
        a, b = self.own_range
        s, e = max(lo, a), min(hi, b)
        if s < e:
            with torch.no_grad():
                self.shard[s - a : e - a].copy_(values[s - lo : e - lo])

    def detach_from(self, p: nn.Parameter) -> None:
        if getattr(p, "_zerorun_init", None) is self:
            del p._zerorun_init  # type: ignore[attr-defined]


def partition_module(
    module: nn.Module,
    comm: Communicator,
    store_device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> int:
    """Partition every parameter of ``module`` not partitioned yet (floating ones in ``dtype``
    when given); returns how many."""
    n = 0
    for p in module.parameters():
        if p.numel() == 0 or hasattr(p, "_zerorun_init") or hasattr(p, "_zerorun_group"):
            continue
        InitShard(p, comm, store_device, dtype)
        n += 1
    return n


def materialize_all(module: nn.Module) -> int:
    """Make every ``zero.Init`` parameter of ``module`` whole again (collective, one parameter at
    a time): what stages 0-2 need when a model built under ``zero.Init`` is trained with them."""
    n = 0
    seen: set[int] = set()
    for p in module.parameters():
        h = getattr(p, "_zerorun_init", None)
        if h is None or id(p) in seen:
            continue
        seen.add(id(p))
        values = h.materialize().view(h.shape).clone()
        h.detach_from(p)
        p.data = values
        n += 1
    return n


class _Gathered:
    """A module's own init-partitioned parameters made whole for a moment (collective)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = [p for p in params if getattr(p, "_zerorun_init", None) is not None]

    def __enter__(self) -> None:
        for p in self.params:
            h = p._zerorun_init  # type: ignore[attr-defined]
            p.data = h.materialize().to(h.home, copy=True).view(h.shape)

    def __exit__(self, *exc: object) -> None:
        for p in self.params:
            h = p._zerorun_init  # type: ignore[attr-defined]
            h.write_full(p.data)
            p.data = h.placeholder


def _all_subclasses(cls: type) -> set[type]:
    out: set[type] = set()
    todo: list[type] = [cls]
    while todo:
        sub: type
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.add(sub)
                todo.append(sub)
    return out


class InitContext:
    """The patching behind ``zerorun.zero.Init`` (one active at a time)."""

    active: InitContext | None = None

    def __init__(
        self, comm: Communicator, store_device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> None:
        self.comm = comm
        self.store_device = store_device
        self.dtype = dtype
        self._depth: dict[int, int] = {}
        self._saved: list[tuple[object, str, object]] = []

    # -- patching -------------------------------------------------------------------------------
    def _set(self, owner: object, name: str, value: object) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, value)

    def _wrap_init(self, cls: type) -> None:
        orig = cls.__dict__.get("__init__")
        if orig is None or getattr(orig, "_zerorun_wrapped", False):
            return
        ctx = self

        @functools.wraps(orig)
        def __init__(module: nn.Module, *args: object, **kwargs: object) -> None:
            key = id(module)
            ctx._depth[key] = ctx._depth.get(key, 0) + 1
            try:
                orig(module, *args, **kwargs)
            finally:
                ctx._depth[key] -= 1
            if ctx._depth[key] == 0:
                del ctx._depth[key]
                if InitContext.active is ctx:
                    partition_module(module, ctx.comm, ctx.store_device, ctx.dtype)
                    install_state_dict_hooks(module)

        __init__._zerorun_wrapped = True  # type: ignore[attr-defined]
        self._set(cls, "__init__", __init__)

    def __enter__(self) -> InitContext:
        if InitContext.active is not None:
            raise RuntimeError("zerorun.zero.Init contexts cannot be nested")
        InitContext.active = self
        for cls in _all_subclasses(nn.Module):
            self._wrap_init(cls)
        ctx = self
        orig_subclass = nn.Module.__dict__.get("__init_subclass__")

        @classmethod  # type: ignore[misc]
        def __init_subclass__(cls: type[nn.Module], **kwargs: object) -> None:
            super(nn.Module, cls).__init_subclass__(**kwargs)
            if InitContext.active is ctx:
                ctx._wrap_init(cls)

        self._set(nn.Module, "__init_subclass__", __init_subclass__)
        del orig_subclass

        def apply(module: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
            for child in module.children():
                child.apply(fn)
            with _Gathered(list(module.parameters(recurse=False))):
                fn(module)
            return module

        self._set(nn.Module, "apply", apply)
        for name in _INIT_FUNCS:
            orig = getattr(torch.nn.init, name, None)
            if orig is not None:
                self._set(torch.nn.init, name, _gathering_init(orig))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, old in reversed(self._saved):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self._saved = []
        InitContext.active = None


class _Missing:
    pass


_MISSING = _Missing()


def _gathering_init(orig: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(orig)
    def init_fn(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if getattr(tensor, "_zerorun_init", None) is None:
            return orig(tensor, *args, **kwargs)
        with _Gathered([tensor]):  # type: ignore[list-item]
            orig(tensor, *args, **kwargs)
        return tensor

    return init_fn
