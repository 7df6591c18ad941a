"""accelerate's DeepSpeed path on CPU ranks: several processes, as on GPUs.

accelerate's ``PartialState`` picks a distributed backend only for accelerators when
``use_cpu`` is off (the DeepSpeed path needs it off), so on CPU ranks it finds none and counts
one process whatever the world size: every rank would train on the whole data set with a
world-1 batch arithmetic. Under the layer on CPU ranks (``ZERORUN_DEVICE=cpu``) its
``_prepare_backend`` answers gloo / multi-CPU there instead -- what it answers for CPU
processes without DeepSpeed -- so the rest of accelerate (process count and index, data
sharding, gathering) works as on GPUs, and the DeepSpeed path then runs on zerorun's gloo
process group. ``activation.py`` applies this when ``accelerate.state`` is imported (stdlib
only here: accelerate is imported by the script, never by this module).
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

__all__ = ["patch_accelerate_state", "wanted"]


def wanted() -> bool:
    return os.environ.get("ZERORUN_DEVICE") == "cpu"


def patch_accelerate_state(state: ModuleType) -> None:
    cls = getattr(state, "PartialState", None)
    original = getattr(cls, "_prepare_backend", None)
    if original is None or getattr(original, "_zerorun", False):
        return

    def _prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None) -> Any:
        chosen, distributed_type = original(self, cpu, sagemaker_dp, backend)
        deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        if chosen is None and not cpu and deepspeed and int(os.environ.get("LOCAL_RANK", "-1")) != -1:
            return "gloo", state.DistributedType.MULTI_CPU
        return chosen, distributed_type

    _prepare_backend._zerorun = True  # type: ignore[attr-defined]
    cls._prepare_backend = _prepare_backend
