"""zerorun's configuration: DeepSpeed-compatible schema, loading, validation (Contract 1).

    from zerorun.config import load_config
    loaded = load_config("ds_config.json")          # or a dict; world_size=N checks the batch
    loaded.config.zero_optimization.stage
    loaded.warnings, loaded.notices

Never imports torch: the launcher validates configs before any rank starts.
"""

from __future__ import annotations

from zerorun.config.batch import OPEN_NOTE, BatchResolution, resolve_batch
from zerorun.config.launcher_section import LauncherSection
from zerorun.config.loader import LoadedConfig, load_config
from zerorun.config.schema import ZerorunConfig
from zerorun.config.training_sections import Bf16, Fp16, OptimizerSection, SchedulerSection
from zerorun.config.types import AUTO
from zerorun.config.zero_section import OffloadOptimizer, OffloadParam, ZeroOptimization
from zerorun.config.zerorun_section import ZerorunSection

__all__ = [
    "AUTO",
    "OPEN_NOTE",
    "BatchResolution",
    "Bf16",
    "Fp16",
    "LauncherSection",
    "LoadedConfig",
    "OffloadOptimizer",
    "OffloadParam",
    "OptimizerSection",
    "SchedulerSection",
    "ZeroOptimization",
    "ZerorunConfig",
    "ZerorunSection",
    "load_config",
    "resolve_batch",
]
