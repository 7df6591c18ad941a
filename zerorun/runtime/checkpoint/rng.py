"""Per-rank RNG states: what is saved, and what a rank restores when the world size changed.

Same world size: rank r restores exactly the state rank r saved (python, numpy, torch CPU and,
where present, CUDA generators), so dropout masks and random data augmentation continue
exactly as in an uninterrupted run.

Different world size (a reshard): there is no "rank r" to continue from for every new rank,
and reusing one saved state on several ranks would give them identical random streams. So
rank r restores the state saved by rank r when that rank existed (r < old world size), and
a new rank r >= old world size is seeded with ``seed(rank 0's torch initial seed + r)``:
distinct per rank and reproducible. A resharded run is therefore not bit-identical to an
uninterrupted one where randomness matters (dropout); it is for deterministic models.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["capture_rng", "restore_rng", "reseed_from"]


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "torch_seed": torch.initial_seed(),
    }
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # numpy is optional at runtime
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        # a rank may now see a different number of devices: restore what both have
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def reseed_from(rank0_state: dict[str, Any], rank: int) -> int:
    """Seed every generator for a rank that did not exist when the checkpoint was saved."""
    seed = (int(rank0_state.get("torch_seed", 0)) + rank) % (2**63)
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:
        pass
    return seed
