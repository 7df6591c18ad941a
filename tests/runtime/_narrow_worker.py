"""One rank (on the GPU when there is one): the same bf16 offloaded training twice -- bf16 gradients on the wire with
cpu_kernel's one-pass Adam, then fp32 gradients and torch's fused kernel (ZERORUN_CPU_KERNEL=0)
-- at stages 1-3 (stage 3 also with parameter offload); writes what test_offload_narrow checks.

argv: OUT_JSON. Run by test_offload_narrow.py via _spawn (world 1).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _models  # noqa: E402
import _offload_cases as oc  # noqa: E402
import _offload_worker as ow  # noqa: E402

import zerorun  # noqa: E402
from zerorun.runtime.offload import cpu_kernel  # noqa: E402

CASES = [
    oc.OCase(1, "bf16", model="wide", steps=4),
    oc.OCase(2, "bf16", model="wide", steps=4),
    oc.OCase(2, "bf16", model="wide", steps=4, optim="adam_l2"),
    oc.OCase(2, "bf16", model="wide", steps=4, optim="sgd"),  # untiled: widened into the fp32 shard first
    oc.OCase(3, "bf16", model="wide", steps=4),
    oc.OCase(3, "bf16", model="wide", steps=4, param="cpu"),
    oc.OCase(2, "bf16", model="wide", steps=5, delayed=True, warmup=1),
]


def train(case: oc.OCase) -> dict:
    model = ow.make_model(case, 77)
    engine, *_ = zerorun.initialize(model=model, config=ow.config_for(case, "/nonexistent"))
    placement = engine.stage.state.placement
    losses = []
    for step in range(case.steps):
        ids, targets = _models.batch(77, step, 0, 0, oc.MICRO_BATCH)
        loss = engine(ids.to(engine.device), targets.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    engine.stage.state.placement.synchronize()
    masters = [m.detach().cpu().clone() for m in engine.stage.state.masters]
    out = {
        "losses": losses,
        "masters": masters,
        "wire": sorted({str(w.dtype) for w in placement.wire if w.numel()}),
        "host_grad_bytes": sum(g.numel() * g.element_size() for g in placement.grads),
    }
    engine.destroy()
    return out


def main() -> None:
    results = {}
    for case in CASES:
        os.environ.pop("ZERORUN_CPU_KERNEL", None)
        cpu_kernel.reset()
        narrow = train(case)
        os.environ["ZERORUN_CPU_KERNEL"] = "0"
        cpu_kernel.reset()
        wide = train(case)
        diffs = [
            ((a - b).abs().max().item(), b.abs().max().item())
            for a, b in zip(narrow["masters"], wide["masters"], strict=True)
        ]
        results[case.name] = {
            "wire": [narrow["wire"], wide["wire"]],
            "losses": [narrow["losses"], wide["losses"]],
            "master_diff": diffs,
            "bitwise": all(torch.equal(a, b) for a, b in zip(narrow["masters"], wide["masters"], strict=True)),
            "host_grad_bytes": [narrow["host_grad_bytes"], wide["host_grad_bytes"]],
        }
    Path(sys.argv[1]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
