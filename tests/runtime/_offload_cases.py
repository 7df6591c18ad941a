"""Offload cases, shared by the worker (runs them) and the tests (check them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class OCase:
    stage: int
    dtype: str  # fp32 | bf16 | fp16
    accum: int = 1
    clip: float = 0.0
    device: str = "cpu"  # offload_optimizer.device: cpu | nvme | none
    param: str = "none"  # offload_param.device (stage 3): none | cpu | nvme
    delayed: bool = False  # zerorun.delayed_param_update
    warmup: int = 0
    optim: str = "adamw"  # adamw | adam_l2 | adam_amsgrad | sgd
    model: str = "tiny"  # tiny (awkward features) | wide (shards > 1024 elements: several NVMe tiles)
    steps: int = 3
    inject: tuple[tuple[int, int], ...] = ()
    ratio: float | str = 1.0  # offload_optimizer.ratio (Twin-Flow); "auto" with budget_gb
    budget_gb: float = 0.0  # zerorun.offload_gpu_budget_gb
    unhooked: int = 0  # flat buffers whose grad_ready the worker withholds (a stage that cannot call it)
    persistence: int = 0  # stage3_param_persistence_threshold (> 0: a persistent group)

    @property
    def name(self) -> str:
        parts = [f"z{self.stage}", self.dtype, f"ga{self.accum}", f"clip{self.clip:g}", f"opt-{self.device}"]
        if self.param != "none":
            parts.append(f"param-{self.param}")
        if self.delayed:
            parts.append(f"dpu{self.warmup}")
        if self.optim != "adamw":
            parts.append(self.optim)
        if self.model != "tiny":
            parts.append(self.model)
        if self.inject:
            parts.append("overflow")
        if self.ratio != 1.0:
            parts.append(f"ratio{self.ratio:g}" if self.ratio != "auto" else f"ratio-auto{self.budget_gb:g}")
        if self.unhooked:
            parts.append(f"unhooked{self.unhooked}")
        if self.persistence:
            parts.append(f"persist{self.persistence}")
        return "-".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)


LR = 2e-2
WEIGHT_DECAY = 0.01
MICRO_BATCH = 2
CLIP = 0.05
BUCKET = {"tiny": 100, "wide": 4096}  # tiny: >= 3 flat buffers; wide: shards > 1024
SUB_GROUP = {"tiny": 48, "wide": 1024}  # several tiles per shard (CPU pipeline / NVMe)


def matrix(world: int) -> list[OCase]:
    if world == 1:
        return [
            OCase(2, "bf16", clip=CLIP),
            OCase(1, "fp32", accum=2, device="nvme", model="wide"),
            OCase(2, "bf16", clip=CLIP, delayed=True, steps=4),
            OCase(3, "bf16", clip=CLIP, param="cpu"),
            OCase(2, "bf16", ratio=0.5),  # Twin-Flow at world 1 (the GPU checks' NCCL group runs it on CUDA)
            # No clipping at stage 3 (CPU steps started in the backward): with parameter offload
            # (CUDA: the write-back into host shards goes through the device) and Twin-Flow.
            OCase(3, "bf16", param="cpu", model="wide"),
            OCase(3, "bf16", ratio=0.5, model="wide"),
            OCase(3, "bf16", param="cpu", model="wide", unhooked=1),  # queued after the backward instead
            # No clipping, optimizer offload only: the write-backs into the device parameters are
            # left to the next forward's module hooks (stages 1-2) / group settles (stage 3).
            OCase(1, "bf16"),
            OCase(2, "bf16", steps=4),
            OCase(3, "bf16", model="wide", steps=4),
            # ... with a persistent group (the biases): at one rank its write-back is deferred too,
            # settled with every group's read (Stage3._persistent) instead of waited for in step().
            OCase(3, "bf16", model="wide", steps=4, persistence=100),
        ]
    # Stage 3 gathers per module group in the forward, so every rank must run the same modules:
    # TinyNet's rank-dependent branch would deadlock it; stage 3 cases use WideNet.
    cases = [
        OCase(stage, dtype, accum, clip, model="wide" if stage == 3 else "tiny")
        for stage in (1, 2, 3)
        for dtype in ("fp32", "bf16")
        for accum, clip in ((1, 0.0), (4, CLIP))
    ]
    cases += [
        OCase(2, "bf16", clip=CLIP, optim="adam_l2"),
        OCase(2, "fp32", optim="adam_amsgrad", device="nvme", model="wide"),
        OCase(1, "fp32", accum=2, optim="sgd"),
        OCase(2, "bf16", clip=CLIP, device="nvme", model="wide"),
        OCase(1, "fp32", accum=2, device="nvme"),
        OCase(3, "bf16", clip=CLIP, device="nvme", param="nvme", model="wide"),
        OCase(3, "fp32", accum=2, device="none", param="cpu", model="wide"),
        OCase(3, "bf16", clip=CLIP, device="cpu", param="cpu", model="wide"),
        OCase(3, "fp32", accum=2, device="cpu", param="cpu", model="wide"),  # write-backs left to the fetches
        OCase(2, "bf16", clip=CLIP, delayed=True, steps=5),
        OCase(1, "fp32", accum=2, delayed=True, warmup=2, steps=5),
        OCase(3, "bf16", delayed=True, steps=4, model="wide"),
        OCase(2, "fp32", clip=CLIP, device="nvme", delayed=True, model="wide", steps=4),
        # Its copies overlapping the next backward (dpu.CopyWindow) with NVMe's staging buffers.
        OCase(2, "bf16", device="nvme", delayed=True, model="wide", steps=4),
        # ... and with stage 3's host parameter shards (gradients down early, write-backs at the step).
        OCase(3, "bf16", param="cpu", delayed=True, model="wide", steps=4),
        OCase(2, "fp16", clip=CLIP, steps=4, inject=((1, world - 1),)),
        # Twin-Flow: part of the masters and states on the device, stepped there concurrently.
        OCase(1, "fp32", ratio=0.5),
        OCase(1, "bf16", accum=2, clip=CLIP, ratio=0.5),
        OCase(2, "bf16", ratio=0.4),
        OCase(2, "fp32", clip=CLIP, ratio=0.7),
        OCase(2, "bf16", clip=CLIP, ratio="auto", budget_gb=1.2e-6),  # 100 elements on the device
        OCase(3, "bf16", clip=CLIP, ratio=0.5, model="wide"),
        OCase(3, "fp32", ratio=0.3, model="wide"),
        OCase(1, "fp32", accum=2, optim="sgd", ratio=0.5),  # untiled: optimizer.step() over both devices
    ]
    return cases


def resume_cases(world: int) -> list[OCase]:
    """Checkpoint save -> load -> continue, with offloaded state (world 2 only)."""
    if world == 1:
        return []
    return [
        OCase(2, "bf16", device="nvme", model="wide"),
        OCase(1, "fp32", device="cpu"),
        OCase(2, "bf16", device="cpu", delayed=True),
        OCase(3, "bf16", device="cpu", model="wide", ratio=0.5),  # Twin-Flow: states on both devices
        OCase(3, "bf16", device="cpu", param="cpu", model="wide"),  # saved with host write-backs in flight
    ]
