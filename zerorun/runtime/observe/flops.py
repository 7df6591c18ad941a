"""The FLOPs profiler (`flops_profiler`): one optimizer step measured in detail.

At the step DeepSpeed profiles (when `profile_step` steps have completed), PyTorch's own FLOP
counter (`torch.utils.flop_counter.FlopCounterMode`: matmuls, convolutions, attention -- not
counted by hand) runs across the step's forward and backward passes, attributed to modules;
forward hooks time every module's forward. Backward FLOPs include the recomputation of
checkpointed activations (it is work the GPU does). The report, on rank 0 (stdout or
`output_file`): parameters, forward/backward FLOPs, latencies, achieved TFLOP/s, MFU against the
device's dense peak where known (or `ZERORUN_PEAK_TFLOPS`), the `top_modules` modules by FLOPs at
`module_depth`, and with `detailed` the module tree. Counting costs time (a dispatch mode on
every op): the profiled step is slower than the others and its latency says so.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerorun.runtime.observe.options import FlopsProfilerOptions

__all__ = ["FlopsProfiler", "peak_flops"]

# Dense peak FLOP/s per GPU: (16-bit, tf32, fp32). Vendor datasheets, without sparsity.
_PEAKS = {
    "H200": (989.4e12, 494.7e12, 66.9e12),
    "H100": (989.4e12, 494.7e12, 66.9e12),
    "A100": (312e12, 156e12, 19.5e12),
}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of `device` for matmuls in `dtype`; None when unknown (CPU)."""
    override = os.environ.get("ZERORUN_PEAK_TFLOPS")
    if override:
        return float(override) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, tf32, fp32) in _PEAKS.items():
        if key in name:
            if dtype in (torch.float16, torch.bfloat16):
                return half
            return tf32 if torch.backends.cuda.matmul.allow_tf32 else fp32
    return None


def _fmt(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}".rstrip()


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        if self.cuda:
            b.synchronize()
            return float(a.elapsed_time(b))
        return (b - a) * 1000.0


class FlopsProfiler:
    """Driven by the StepReporter's phase hooks; active during one optimizer step only."""

    def __init__(
        self,
        options: FlopsProfilerOptions,
        module: nn.Module,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        compute_dtype: torch.dtype,
        micro_batch: int,
        write: Callable[[str], None],
    ) -> None:
        self.options = options
        self.module = module
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.compute_dtype = compute_dtype
        self.micro_batch = micro_batch
        self._write = write
        self._clock = _Clock(device)
        self.active = False
        self.done = False
        self._mode: Any = None
        self._fwd: dict[str, int] = {}
        self._total: dict[str, int] = {}
        self._at_fwd_start: dict[str, int] = {}
        self._phase_marks: dict[str, list[tuple[Any, Any]]] = {}
        self._open: dict[str, Any] = {}
        self._mod_marks: dict[str, list[tuple[Any, Any]]] = {}
        self._mod_open: dict[str, list[Any]] = {}
        self._handles: list[Any] = []
        self._numel: dict[int, int] = {}  # parameter id -> elements, seen while gathered (stage 3)
        self.last_report: dict[str, Any] | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def maybe_start(self, completed_steps: int) -> None:
        if self.options.enabled and not self.done and not self.active and completed_steps == self.options.profile_step:
            self.active = True
            self._root = type(self.module).__name__
            self._names = {m: self._key(n) for n, m in self.module.named_modules()}
            self._handles = [
                nn.modules.module.register_module_forward_pre_hook(self._pre),
                nn.modules.module.register_module_forward_hook(self._post),
            ]

    def _key(self, name: str) -> str:
        return self._root if not name else f"{self._root}.{name}"

    def _pre(self, module: nn.Module, _args: Any) -> None:
        name = self._names.get(module)
        if name is not None:
            self._mod_open.setdefault(name, []).append(self._clock.mark())

    def _post(self, module: nn.Module, _args: Any, _out: Any) -> None:
        # Global forward hooks run before the module's own: at stage 3 its parameters are still
        # gathered here (they are empty placeholders outside the forward).
        for p in module.parameters(recurse=False):
            self._numel[id(p)] = max(self._numel.get(id(p), 0), p.numel())
        name = self._names.get(module)
        if name is not None and self._mod_open.get(name):
            self._mod_marks.setdefault(name, []).append((self._mod_open[name].pop(), self._clock.mark()))

    def _counts(self) -> dict[str, int]:
        return {k: sum(v.values()) for k, v in self._mode.get_flop_counts().items()} if self._mode else {}

    def enter_phase(self, name: str) -> None:
        if not self.active:
            return
        if name == "fwd":
            if self._mode is None:
                from torch.utils.flop_counter import FlopCounterMode

                self._mode = FlopCounterMode(display=False)
                self._mode.__enter__()
            self._at_fwd_start = self._counts()
        elif name == "step":
            self._stop_counting()
        if name in ("fwd", "bwd", "step"):
            self._open[name] = self._clock.mark()

    def exit_phase(self, name: str) -> None:
        if not self.active:
            return
        if name in self._open:
            self._phase_marks.setdefault(name, []).append((self._open.pop(name), self._clock.mark()))
        if name == "fwd" and self._mode is not None:
            now = self._counts()
            for k, v in now.items():
                self._fwd[k] = self._fwd.get(k, 0) + v - self._at_fwd_start.get(k, 0)

    def _stop_counting(self) -> None:
        if self._mode is not None:
            self._total = self._counts()
            self._mode.__exit__(None, None, None)
            self._mode = None

    def after_step(self, step: int, micro_steps: int) -> None:
        if not self.active:
            return
        self._stop_counting()
        for h in self._handles:
            h.remove()
        self._handles = []
        self.active, self.done = False, True
        report = self._summarise(step, micro_steps)
        self.last_report = report
        if self.rank == 0:
            self._write(self._render(report))

    # -- the report -------------------------------------------------------------------------
    def _params(self, module: nn.Module) -> int:
        return sum(
            max(self._numel.get(id(p), 0), int(getattr(p, "ds_numel", p.numel()))) for p in module.parameters()
        )

    def _summarise(self, step: int, micro_steps: int) -> dict[str, Any]:
        ms = {k: sum(self._clock.ms(a, b) for a, b in v) for k, v in self._phase_marks.items()}
        total = self._total.get("Global", 0)
        fwd = self._fwd.get("Global", 0)
        bwd = total - fwd
        compute_ms = ms.get("fwd", 0.0) + ms.get("bwd", 0.0)
        step_ms = compute_ms + ms.get("step", 0.0)
        achieved = total / (step_ms / 1000.0) if step_ms > 0 else 0.0
        peak = peak_flops(self.device, self.compute_dtype)
        modules = []
        for module, name in self._names.items():
            depth = 0 if name == self._root else name.count(".")
            fwd_ms = sum(self._clock.ms(a, b) for a, b in self._mod_marks.get(name, ()))
            mod_total = self._total.get(name, 0)
            mod_fwd = self._fwd.get(name, 0)
            modules.append(
                {
                    "name": name,
                    "depth": depth,
                    "params": self._params(module),
                    "fwd_flops": mod_fwd,
                    "bwd_flops": mod_total - mod_fwd,
                    "fwd_ms": fwd_ms,
                }
            )
        return {
            "step": step,
            "world_size": self.world_size,
            "micro_batch": self.micro_batch,
            "micro_steps": micro_steps,
            "params": self._params(self.module),
            "fwd_flops": fwd,
            "bwd_flops": bwd,
            "fwd_ms": ms.get("fwd", 0.0),
            "bwd_ms": ms.get("bwd", 0.0),
            "step_ms": ms.get("step", 0.0),
            "achieved_flops_per_s": achieved,
            "peak_flops_per_s": peak,
            "mfu": achieved / peak if peak else None,
            "modules": modules,
        }

    def _render(self, r: dict[str, Any]) -> str:
        o = self.options
        lines = [
            f"---------------- zerorun flops profiler (DeepSpeed's flops_profiler), step {r['step']} ----------------",
            f"world size: {r['world_size']}   micro batch per rank: {r['micro_batch']}   micro-steps profiled: {r['micro_steps']}",
            f"params per rank (full model): {_fmt(r['params'], '')}",
            f"fwd FLOPs per rank: {_fmt(r['fwd_flops'], 'FLOP')}   latency {r['fwd_ms']:.2f} ms",
            f"bwd FLOPs per rank: {_fmt(r['bwd_flops'], 'FLOP')}   latency {r['bwd_ms']:.2f} ms"
            + ("   (bwd/fwd = %.2f)" % (r["bwd_flops"] / r["fwd_flops"]) if r["fwd_flops"] else ""),
            f"optimizer step latency: {r['step_ms']:.2f} ms",
            f"achieved per rank (fwd+bwd FLOPs / fwd+bwd+step time): {_fmt(r['achieved_flops_per_s'], 'FLOP/s')}",
        ]
        if r["mfu"] is not None:
            lines.append(f"MFU: {100 * r['mfu']:.1f} % of {_fmt(r['peak_flops_per_s'], 'FLOP/s')} dense peak")
        else:
            lines.append("MFU: - (peak of this device unknown; set ZERORUN_PEAK_TFLOPS)")
        depth = o.module_depth if o.module_depth >= 0 else max(m["depth"] for m in r["modules"])
        at_depth = [m for m in r["modules"] if m["depth"] == depth] or r["modules"]
        top = sorted(at_depth, key=lambda m: m["fwd_flops"] + m["bwd_flops"], reverse=True)[: o.top_modules]
        lines.append(f"top {len(top)} module(s) at depth {depth} by fwd+bwd FLOPs:")
        for m in top:
            lines.append(f"  {m['name']}: {_fmt(m['fwd_flops'] + m['bwd_flops'], 'FLOP')}, params {_fmt(m['params'], '')}")
        if o.detailed:
            total = max(r["fwd_flops"] + r["bwd_flops"], 1)
            lines.append("detailed (module: params, fwd FLOPs, bwd FLOPs, share of fwd+bwd, fwd latency):")
            for m in r["modules"]:
                if o.module_depth >= 0 and m["depth"] > o.module_depth:
                    continue
                share = 100 * (m["fwd_flops"] + m["bwd_flops"]) / total
                lines.append(
                    f"  {'  ' * m['depth']}{m['name'].rsplit('.', 1)[-1]}: {_fmt(m['params'], '')}, "
                    f"{_fmt(m['fwd_flops'], 'FLOP')}, {_fmt(m['bwd_flops'], 'FLOP')}, {share:.1f} %, {m['fwd_ms']:.2f} ms"
                )
        lines.append("-" * 100)
        return "\n".join(lines) + "\n"
