"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedule names and zerorun's schedules.

``VALID_LR_SCHEDULES`` is DeepSpeed's list of schedule class names; accelerate uses it to tell
a DeepSpeed scheduler (handed to ``deepspeed.initialize``) from a torch one. The classes are
zerorun's implementations with DeepSpeed's semantics (runtime/scheduler.py).
"""

from __future__ import annotations

from zerorun.compat.deepspeed._surface import module_getattr
from zerorun.runtime.scheduler import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "VALID_LR_SCHEDULES",
    "LR_RANGE_TEST",
    "ONE_CYCLE",
    "WARMUP_LR",
    "WARMUP_DECAY_LR",
    "WARMUP_COSINE_LR",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
]

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

__getattr__ = module_getattr(__name__)
