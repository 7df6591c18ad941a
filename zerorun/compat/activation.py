"""Making `import deepspeed` resolve to zerorun's compatibility layer, inside one process.

Entries at the front of ``sys.meta_path`` (stdlib only, nothing imported until a script
asks for ``deepspeed``):

* ``AliasFinder``: ``deepspeed`` and ``deepspeed.X.Y`` are the modules
  ``zerorun.compat.deepspeed`` and ``zerorun.compat.deepspeed.X.Y`` -- the *same* module
  objects under both names, so classes compare equal whichever name imported them
  (accelerate does ``isinstance(model, deepspeed.DeepSpeedEngine)``). A name the layer does
  not have raises ModuleNotFoundError naming it, instead of a bare "No module named".
* ``DistributionFinder``: ``importlib.metadata`` sees a distribution ``deepspeed`` with version
  ``COMPAT_VERSION``. transformers and accelerate count DeepSpeed as available only when
  ``find_spec("deepspeed")`` *and* ``metadata("deepspeed")`` both succeed, and gate features on
  the version; nothing is ever installed under the name deepspeed.

* ``AcceleratePatcher`` (CPU ranks only): accelerate's DeepSpeed path counts every process
  (accelerate_cpu.py).

When a real DeepSpeed is installed as well, ``activate`` says once (rank 0) that this process
uses the layer, not that installation.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

__all__ = [
    "COMPAT_VERSION",
    "ENV_VAR",
    "INSTALLER",
    "AliasFinder",
    "DistributionFinder",
    "activate",
    "deactivate",
    "is_active",
    "is_ours",
    "real_deepspeed",
]

# The version transformers/accelerate read. It decides which of their optional paths run
# (accelerate 1.15): >=0.9.3 is required at all; >=0.3.1 maps offload optimizers with
# `adamw_mode`; >=0.14.4 makes `torch_compile` call `engine.compile` (so it reaches this layer
# and gets a clear answer instead of being skipped silently); >=0.16.4 lets DeepSpeed-TP
# configs reach `deepspeed.tp_model_init` (which says TP is not supported) instead of an
# "upgrade DeepSpeed" message. 0.18.2 (Ulysses sequence parallelism) is deliberately not
# reached: accelerate then refuses SP before touching anything, which is true of zerorun too.
COMPAT_VERSION = "0.16.4+zerorun"
ENV_VAR = "ZERORUN_DEEPSPEED_COMPAT"
# The INSTALLER of the layer's deepspeed distributions: the in-process one below and the
# dist-info `zerorun compat install` writes (venv_install.py). Anything else is a real DeepSpeed.
INSTALLER = "zerorun"
_ROOT = "deepspeed"
_TARGET = "zerorun.compat.deepspeed"
# Names that are attributes in DeepSpeed and that scripts also import as modules.
_ALIASES = {"deepspeed.zero": "zerorun.compat.deepspeed.runtime.zero"}


def _target_of(fullname: str) -> str:
    if fullname in _ALIASES:
        return _ALIASES[fullname]
    return _TARGET + fullname[len(_ROOT) :]


class _AliasLoader(importlib.abc.Loader):
    """Loads ``deepspeed.X`` by importing ``zerorun.compat.deepspeed.X`` and handing over that
    very module object (its own ``__name__``/``__spec__`` are kept)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._own_spec: Any = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # Already executed under its zerorun name; the import system has just given it the
        # alias spec: put its own back (reload, pickling and find_spec of the zerorun name).
        module.__spec__ = self._own_spec


class AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _ROOT and not fullname.startswith(_ROOT + "."):
            return None
        real = _target_of(fullname)
        if real in sys.modules:
            found = True
        else:
            try:
                found = importlib.util.find_spec(real) is not None
            except ModuleNotFoundError:
                found = False
        if not found:
            raise ModuleNotFoundError(
                f"{fullname} is not part of zerorun's DeepSpeed compatibility layer "
                f"(`import deepspeed` resolves to zerorun.compat.deepspeed, version {COMPAT_VERSION}); "
                "docs/migration-from-deepspeed.md lists what it provides",
                name=fullname,
            )
        is_package = importlib.util.find_spec(real).submodule_search_locations is not None  # type: ignore[union-attr]
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real), is_package=is_package)


class _CompatDistribution(importlib.metadata.Distribution):
    """The metadata of the layer, as a distribution named deepspeed (no files on disk)."""

    _METADATA = (
        "Metadata-Version: 2.1\n"
        "Name: deepspeed\n"
        f"Version: {COMPAT_VERSION}\n"
        "Summary: zerorun's DeepSpeed compatibility layer (not DeepSpeed)\n"
        "Home-page: https://github.com/zerorun/zerorun\n"
        "Author: zerorun\n"
        "License: Apache-2.0\n"
    )

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return self._METADATA
        if filename == "top_level.txt":
            return "deepspeed\n"
        if filename == "INSTALLER":
            return INSTALLER + "\n"
        return None

    def locate_file(self, path: Any) -> Any:
        import pathlib

        return pathlib.Path(__file__).parent / "deepspeed" / str(path)


class DistributionFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, *_args: Any, **_kwargs: Any) -> None:
        return None  # metadata only; modules come from AliasFinder

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context = importlib.metadata.DistributionFinder.Context()
    ) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.lower().replace("_", "-") == _ROOT:
            yield _CompatDistribution()


class _PatchingLoader(importlib.abc.Loader):
    """Runs a module's own loader, then a patch on the module (see AcceleratePatcher)."""

    def __init__(self, inner: Any, patch: Any) -> None:
        self.inner = inner
        self.patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class AcceleratePatcher(importlib.abc.MetaPathFinder):
    """On CPU ranks: ``accelerate.state`` counts every process on its DeepSpeed path
    (compat/accelerate_cpu.py); patched as it is imported."""

    _TARGET = "accelerate.state"

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self._TARGET:
            return None
        from zerorun.compat import accelerate_cpu

        if not accelerate_cpu.wanted():
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, accelerate_cpu.patch_accelerate_state)
        return spec


_alias = AliasFinder()
_dists = DistributionFinder()
_accelerate = AcceleratePatcher()


def is_active() -> bool:
    return _alias in sys.meta_path


def is_ours(dist: importlib.metadata.Distribution) -> bool:
    """Whether a deepspeed distribution is the layer's (not a real DeepSpeed)."""
    return (dist.read_text("INSTALLER") or "").strip() == INSTALLER


def real_deepspeed() -> tuple[str, str] | None:
    """(version, location) of a DeepSpeed installed in this environment, ignoring the layer."""
    was_active, had_metadata = is_active(), _dists in sys.meta_path
    if was_active:
        deactivate()
    try:
        # Not the layer's own `zerorun compat install` (its dist-info's INSTALLER is zerorun).
        dists = [d for d in importlib.metadata.distributions(name=_ROOT) if not is_ours(d)]
    finally:
        if was_active:
            _install(had_metadata)
    if not dists:
        return None
    return dists[0].version, str(dists[0].locate_file(""))


def _install(metadata: bool = True) -> None:
    for finder in (_accelerate, _dists, _alias) if metadata else (_accelerate, _alias):
        if finder not in sys.meta_path:
            sys.meta_path.insert(0, finder)
    loaded = sys.modules.get(AcceleratePatcher._TARGET)
    if loaded is not None:
        from zerorun.compat import accelerate_cpu

        if accelerate_cpu.wanted():
            accelerate_cpu.patch_accelerate_state(loaded)


def activate(*, announce: bool = True, metadata: bool = True) -> None:
    """From now on `import deepspeed` in this process is zerorun's layer. Idempotent.
    ``metadata=False``: no in-process distribution (``zerorun compat install`` wrote a real
    dist-info, which pip must find to uninstall it)."""
    if is_active():
        return
    real = real_deepspeed()
    loaded = sys.modules.get(_ROOT)
    if loaded is not None and not getattr(loaded, "__name__", "").startswith(_TARGET):
        raise ImportError(
            "the real deepspeed was already imported in this process before zerorun's compatibility "
            "layer was activated; activate it first (zerorun --deepspeed-compat does so before the script runs)"
        )
    _install(metadata)
    _pin_accelerate_device()
    if announce and real is not None and os.environ.get("RANK", "0") == "0":
        version, where = real
        sys.stderr.write(
            f"zerorun: `import deepspeed` in this job is zerorun's compatibility layer ({COMPAT_VERSION}), "
            f"not the DeepSpeed {version} installed at {where}; to use that one, launch with `deepspeed` "
            "instead of `zerorun --deepspeed-compat`\n"
        )


def _pin_accelerate_device() -> None:
    """accelerate puts a rank on GPU ``LOCAL_RANK % device_count`` whenever it sees one; zerorun
    uses ``LOCAL_RANK // K`` with ``--ranks_per_gpu K`` (the shim already selected it), or the
    CPU with ``--device cpu``. accelerate takes an explicit device from ACCELERATE_TORCH_DEVICE,
    so both agree."""
    device = os.environ.get("ZERORUN_DEVICE")
    if device not in ("cuda", "cpu") or "ACCELERATE_TORCH_DEVICE" in os.environ:
        return
    if device == "cpu":
        os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
        return
    try:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        per_gpu = max(1, int(os.environ.get("ZERORUN_RANKS_PER_GPU", "1")))
    except ValueError:
        return
    os.environ["ACCELERATE_TORCH_DEVICE"] = f"cuda:{local // per_gpu}"


def deactivate() -> None:
    """Remove the finders (tests). Modules already imported as deepspeed.* stay in sys.modules."""
    for finder in (_alias, _dists, _accelerate):
        while finder in sys.meta_path:
            sys.meta_path.remove(finder)
