"""The equivalence matrix, shared by the worker (which runs it) and the tests (which check it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from itertools import product


@dataclass(frozen=True)
class Case:
    stage: int
    dtype: str  # "fp32" | "bf16" | "fp16"
    accum: int
    clip: float
    steps: int = 3
    inject: tuple[tuple[int, int], ...] = ()  # (step, rank): that rank's loss becomes inf
    comm: str | None = None  # communication_data_type

    @property
    def name(self) -> str:
        base = f"z{self.stage}-{self.dtype}-ga{self.accum}-clip{self.clip:g}"
        return base + ("-overflow" if self.inject else "") + (f"-comm{self.comm}" if self.comm else "")

    def to_dict(self) -> dict:
        return asdict(self)


MICRO_BATCH = 2
LR = 2e-2
WEIGHT_DECAY = 0.01
BUCKET = 100  # elements: TinyNet's ~600 trainable elements make >= 3 buckets
CLIP = 0.05  # well below TinyNet's gradient norm, so clipping really scales


def matrix(world: int) -> list[Case]:
    cases = [
        Case(stage, dtype, accum, clip)
        for stage, dtype, accum, clip in product((0, 1, 2), ("fp32", "bf16"), (1, 4), (0.0, CLIP))
    ]
    if world > 1:
        # fp16 overflow on the last rank only, at steps 1 and 2: hysteresis 2 absorbs the first,
        # the second halves the scale; the window of 2 doubles it again after step 4.
        cases += [
            Case(stage, "fp16", 1, CLIP, steps=5, inject=((1, world - 1), (2, world - 1)))
            for stage in (0, 1, 2)
        ]
        # Gradients reduced (and kept) in bf16: communication_data_type.
        cases += [Case(stage, "bf16", 2, CLIP, comm="bf16") for stage in (0, 2)]
    return cases
