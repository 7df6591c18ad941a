"""RESULTS.md from result records: one table per run, ratios to plain PyTorch and to FSDP2.

    python benchmarks/report.py                          # benchmarks/results/*.json -> RESULTS.md
    python benchmarks/report.py --import-bundle results.jsonl   # a run from the GPU machine first

Ratios compare tokens/s per GPU within one run (same machine, same call). The plain baseline
runs twice per call; its spread is the noise band, and "not below FSDP2" means not below it
by more than that band. Losses: every configuration trains the same model on the same data,
so its final loss must be within `--loss-rtol` (relative) of the baseline's.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.configs import CATALOGUE  # noqa: E402
from benchmarks.largest_model import RESULTS_DIR as LARGEST_DIR  # noqa: E402
from benchmarks.largest_model_report import load as load_largest  # noqa: E402
from benchmarks.largest_model_report import render_section  # noqa: E402
from benchmarks.results import import_bundle, load_records  # noqa: E402

__all__ = ["render", "render_run", "console_table", "baseline", "main"]

GIB = 1024**3
_ORDER = {name: i for i, name in enumerate(CATALOGUE)}


# The offload rows' targets (issue 17), one table, one row each. Every row is compared with
# zerorun's own no-offload row of the same stage in the same run (`ref`), and judged against its
# own least ratio of tokens/s: ✓ at or above it, ✗ below. `halfway_from` names the full-offload
# row of a partial-offload (Twin-Flow ratio) row: its peak GPU memory must also be at most halfway
# between that row's and `ref`'s (the issue's "ratio at the value that keeps the peak GPU memory
# <= halfway between full offload and no offload").
class OffloadTarget(NamedTuple):
    ref: str
    least: float
    about: str
    halfway_from: str | None = None


OFFLOAD_TARGETS: dict[str, OffloadTarget] = {
    "zero2_offload_opt": OffloadTarget("zero2", 0.65, "exact CPU offload"),
    "zero3_offload_opt": OffloadTarget("zero3", 0.65, "exact CPU offload"),
    "zero2_offload_ratio": OffloadTarget("zero2", 0.85, "Twin-Flow ratio {ratio}, exact", "zero2_offload_opt"),
    "zero3_offload_ratio": OffloadTarget("zero3", 0.85, "Twin-Flow ratio {ratio}, exact", "zero3_offload_opt"),
    "zero2_offload_dpu": OffloadTarget("zero2", 0.75, "with the delayed update"),
    "zero2_zenflow": OffloadTarget(
        "zero2", 0.90, "ZenFlow, top 5 % of columns on the GPU, the rest every 4 steps"
    ),
    "zero3_offload_param": OffloadTarget("zero3", 0.60, "exact CPU offload, parameters on the host too"),
}


def _sort_key(r: dict[str, Any]) -> tuple[int, int]:
    return (_ORDER.get(str(r.get("config")), 99), int(r.get("repeat", 1)))


def _label(r: dict[str, Any]) -> str:
    rep = int(r.get("repeat", 1))
    label = f"{r['config']} (run {rep})" if rep > 1 else str(r["config"])
    override = _override(r)
    return f"{label} + `{override}`" if override else label


def _override(r: dict[str, Any]) -> str | None:
    """The run's ``--zerorun-override`` (a config change for an experiment), if any."""
    if r.get("zerorun_override"):
        return str(r["zerorun_override"])
    argv = [str(a) for a in r.get("launch_argv") or []]
    if "--zerorun-override" in argv[:-1]:
        return argv[argv.index("--zerorun-override") + 1]
    return None


def _ok(r: dict[str, Any] | None) -> bool:
    return bool(r) and r.get("status") == "ok" and r.get("tokens_per_s_per_gpu") is not None


def baseline(records: Sequence[dict[str, Any]]) -> tuple[float | None, float | None, float | None]:
    """(mean tokens/s/GPU of the ok plain runs, relative spread max-min/mean, mean final loss)."""
    plain = [r for r in records if r.get("config") == "plain" and _ok(r)]
    if not plain:
        return None, None, None
    tps = [float(r["tokens_per_s_per_gpu"]) for r in plain]
    mean = sum(tps) / len(tps)
    band = (max(tps) - min(tps)) / mean if len(tps) > 1 else None
    losses = [float(r["final_loss"]) for r in plain if r.get("final_loss") is not None]
    return mean, band, (sum(losses) / len(losses) if losses else None)


def _f(v: Any, fmt: str, scale: float = 1.0) -> str:
    return "–" if v is None else format(float(v) / scale, fmt)


def _first_line(text: Any, limit: int = 140) -> str:
    line = str(text or "").strip().splitlines()[0] if str(text or "").strip() else ""
    line = line.replace("|", "\\|")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def render_run(records: Sequence[dict[str, Any]], loss_rtol: float = 0.01) -> str:
    """Markdown for one run (records sharing a run_id): header, table, targets, failures."""
    recs = sorted(records, key=_sort_key)
    thr = [r for r in recs if r.get("mode", "throughput") == "throughput"]
    mem = [r for r in recs if r.get("mode") == "memory"]
    head = next((r for r in recs if r.get("status") == "ok"), recs[0])
    out = [f"### Run `{head['run_id']}`", ""]
    gpu = head.get("gpu_name") or f"CPU ({head.get('cpu') or '?'}, {head.get('cpu_count') or '?'} cores)"
    worlds = sorted({int(r["world_size"]) for r in recs if r.get("world_size")})
    params = head.get("n_params")
    out.append(
        f"{gpu}; world size {', '.join(map(str, worlds)) or '?'}; torch {head.get('torch_version', '?')}"
        f" (CUDA {head.get('cuda_version') or '–'}); model {head.get('size')}"
        f" ({_f(params, ',.0f')} parameters), sequence {head.get('seq_len', '?')},"
        f" micro batch {head.get('micro_batch', '?')} per GPU; started {head.get('started_at', '?')}."
    )
    out.append("")
    if head.get("device") == "cpu":
        out += [
            "> CPU run on a small shared machine (gloo): it validates the harness end to end; its speeds"
            " say nothing about GPU performance.",
            "",
        ]
    if thr:
        out += _throughput_section(thr, loss_rtol)
    if mem:
        out += _memory_section(mem)
    for r in recs:
        if r.get("profile_top_ops"):
            out += [
                "",
                f"<details><summary>profile of <code>{_label(r)}</code> (rank 0, steps after the timed ones)</summary>",
                "",
                "```text",
                str(r["profile_top_ops"]).rstrip(),
                "```",
                "</details>",
            ]
    failed = [r for r in recs if r.get("status") != "ok"]
    if failed:
        out += ["", "Not measured:", ""]
        for r in failed:
            out.append(
                f"- `{_label(r)}` ({r.get('mode', 'throughput')}): **{r.get('status')}** — {_first_line(r.get('error'))}"
            )
    return "\n".join(out) + "\n"


def loss_references(recs: Sequence[dict[str, Any]]) -> dict[int, tuple[str, float]]:
    """World size -> (configuration, final loss) every row of that world size is checked against.

    World 1: the plain baseline (mean of its runs). World N > 1 trains on N ranks' batches, so
    the reference is the first of DDP, FSDP2 that finished at that world size."""
    refs: dict[int, tuple[str, float]] = {}
    _, _, plain_loss = baseline(recs)
    if plain_loss is not None:
        refs[1] = ("plain", plain_loss)
    for name in ("ddp", "fsdp2"):
        for r in recs:
            w = int(r.get("world_size") or 1)
            if r.get("config") == name and _ok(r) and r.get("final_loss") is not None and w not in refs:
                refs[w] = (name, float(r["final_loss"]))
    return refs


def _throughput_section(recs: Sequence[dict[str, Any]], loss_rtol: float) -> list[str]:
    base_tps, band, _ = baseline(recs)
    loss_refs = loss_references(recs)
    fsdp = next((r for r in recs if r.get("config") == "fsdp2" and _ok(r)), None)
    head = next((r for r in recs if _ok(r)), recs[0])
    peak = head.get("peak_flops_per_gpu")
    out = [
        f"{head.get('timed_steps', '?')} timed steps after {head.get('warmup_steps', '?')} warm-up;"
        f" median step time. FLOPs per token {_f(head.get('flops_per_token'), '.3e')}"
        f" ({head.get('flop_formula', '?')}); MFU against "
        + (
            f"{peak / 1e12:.0f} TFLOP/s dense bf16 per GPU."
            if peak
            else "no stated peak (none known for this device)."
        )
    ]
    if band is not None:
        out.append(f"Noise band (the two plain runs): {band * 100:.1f} % in tokens/s per GPU.")
    else:
        out.append("Noise band: unknown (fewer than two plain runs finished).")
    out += [
        "",
        "| configuration | status | tokens/s | tokens/s/GPU | step ms | TFLOP/s/GPU | MFU | GPU peak alloc GiB"
        " | GPU peak reserved GiB | host RSS GiB | final loss | × plain | × FSDP2 | mem ÷ FSDP2 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in recs:
        if not _ok(r):
            out.append(f"| {_label(r)} | {r.get('status')} |" + " – |" * 12)
            continue
        tps = float(r["tokens_per_s_per_gpu"])
        loss = r.get("final_loss")
        mark = ""
        ref = loss_refs.get(int(r.get("world_size") or 1))
        if loss is not None and ref is not None:
            mark = " ✓" if abs(float(loss) - ref[1]) <= loss_rtol * abs(ref[1]) else " ✗"
        fsdp_mem = fsdp.get("gpu_mem_peak_allocated_bytes") if fsdp else None
        mem_ratio = (
            float(r["gpu_mem_peak_allocated_bytes"]) / float(fsdp_mem)
            if fsdp_mem and r.get("gpu_mem_peak_allocated_bytes") is not None
            else None
        )
        out.append(
            "| "
            + " | ".join(
                [
                    _label(r),
                    "ok",
                    _f(r.get("tokens_per_s"), ",.0f"),
                    _f(tps, ",.0f"),
                    _f(r.get("step_time_median_s"), ".1f", 1e-3),
                    _f(r.get("tflops_per_gpu"), ".1f" if (r.get("tflops_per_gpu") or 0) >= 1 else ".2g"),
                    _f(r.get("mfu"), ".1%") if r.get("mfu") is not None else "–",
                    _f(r.get("gpu_mem_peak_allocated_bytes"), ".1f", GIB),
                    _f(r.get("gpu_mem_peak_reserved_bytes"), ".1f", GIB),
                    _f(r.get("host_rss_peak_bytes"), ".1f", GIB),
                    _f(loss, ".4f") + mark,
                    _f(tps / base_tps if base_tps else None, ".2f"),
                    _f(tps / float(fsdp["tokens_per_s_per_gpu"]) if fsdp else None, ".2f"),
                    _f(mem_ratio, ".2f"),
                ]
            )
            + " |"
        )
    out.append("")
    refs = "; ".join(f"world {w}: {name} {loss:.4f}" for w, (name, loss) in sorted(loss_refs.items()))
    out.append(
        f"Loss check: ✓ = final loss within {loss_rtol:.0%} (relative) of the reference trained on the same"
        f" data ({refs or 'none finished'}); every configuration starts from the same weights and sees the same batches."
    )
    if head.get("device") == "cpu":
        out += ["", "Targets: not evaluated (they are about GPUs)."]
    else:
        out += _targets(recs, fsdp, band)
    return out


def _targets(recs: Sequence[dict[str, Any]], fsdp: dict[str, Any] | None, band: float | None) -> list[str]:
    by = {r["config"]: r for r in recs if _ok(r) and int(r.get("repeat", 1)) == 1}
    lines = []
    if fsdp:
        f_tps, f_mem = float(fsdp["tokens_per_s_per_gpu"]), fsdp.get("gpu_mem_peak_allocated_bytes")
        tol = band or 0.0
        for name in ("zero0", "zero1", "zero2", "zero3"):
            r = by.get(name)
            if not r:
                continue
            ratio = float(r["tokens_per_s_per_gpu"]) / f_tps
            speed = "✓" if ratio >= 1 - tol else "✗"
            mem = r.get("gpu_mem_peak_allocated_bytes")
            mem_ok = "–" if mem is None or f_mem is None else ("✓" if mem <= f_mem else "✗")
            lines.append(
                f"- `{name}`: speed {ratio:.2f}× FSDP2 {speed} (target ≥ FSDP2 − noise band {tol:.1%}); "
                f"peak memory ≤ FSDP2's {mem_ok}"
            )
    compiled_peer = by.get("fsdp2_compile")
    if compiled_peer:  # issue 20: each stage + compile >= FSDP2 + compile minus the noise band
        tol = band or 0.0
        for s in range(4):
            r = by.get(f"zero{s}_compile")
            if r:
                ratio = float(r["tokens_per_s_per_gpu"]) / float(compiled_peer["tokens_per_s_per_gpu"])
                lines.append(
                    f"- `zero{s}_compile`: speed {ratio:.2f}× `fsdp2_compile` {'✓' if ratio >= 1 - tol else '✗'}"
                    f" (target ≥ FSDP2+compile − noise band {tol:.1%})"
                )
    fsdp_row = by.get("fsdp2")
    for s in (2, 3):  # issue 20: the fair world-1 rows (real collectives) against FSDP2
        r = by.get(f"zero{s}_collectives")
        if r and fsdp_row:
            ratio = float(r["tokens_per_s_per_gpu"]) / float(fsdp_row["tokens_per_s_per_gpu"])
            mem, f_mem = r.get("gpu_mem_peak_allocated_bytes"), fsdp_row.get("gpu_mem_peak_allocated_bytes")
            mem_ok = "–" if mem is None or f_mem is None else ("✓" if mem <= f_mem else "✗")
            lines.append(
                f"- `zero{s}_collectives`: speed {ratio:.2f}× FSDP2 {'✓' if ratio >= 1 - (band or 0.0) else '✗'}"
                f" (target ≥ FSDP2 − noise band); peak memory ≤ FSDP2's {mem_ok}"
            )
    lines += offload_target_lines(by)
    return (["", "Targets:", "", *lines]) if lines else []


def offload_target_lines(by: dict[str, dict[str, Any]]) -> list[str]:
    """One line per offload row of OFFLOAD_TARGETS present with its reference row (`by`: config
    name -> ok record of one run)."""
    lines = []
    for off, t in OFFLOAD_TARGETS.items():
        if off not in by or t.ref not in by:
            continue
        ratio = float(by[off]["tokens_per_s_per_gpu"]) / float(by[t.ref]["tokens_per_s_per_gpu"])
        # Three decimals where two would round a miss up to the target (0.846 is not 0.85).
        shown = f"{ratio:.3f}" if ratio < t.least <= round(ratio, 2) else f"{ratio:.2f}"
        about = t.about.replace("{ratio}", _offload_ratio(by[off]))
        line = f"- `{off}`: {shown}× `{t.ref}` {'✓' if ratio >= t.least else '✗'} (target ≥ {t.least:.2f}×, {about})"
        full = by.get(t.halfway_from) if t.halfway_from else None
        mems = [r.get("gpu_mem_peak_allocated_bytes") for r in (by[off], full, by[t.ref]) if r is not None]
        if full is not None and len(mems) == 3 and None not in mems:
            mem, full_mem, none_mem = (float(m) for m in mems)
            half = (full_mem + none_mem) / 2
            line += (
                f"; peak GPU memory {mem / GIB:.1f} GiB {'≤' if mem <= half else '>'} halfway {half / GIB:.1f} GiB"
                f" between `{t.halfway_from}` and `{t.ref}` {'✓' if mem <= half else '✗'}"
            )
        lines.append(line)
    return lines


def _offload_ratio(rec: dict[str, Any]) -> str:
    """The Twin-Flow ratio the record ran with (its own config: the catalogue's value changed)."""
    cfg = rec.get("zerorun_config") or {}
    ratio = ((cfg.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("ratio")
    return "?" if ratio is None else f"{ratio:g}" if isinstance(ratio, float | int) else str(ratio)


def _memory_section(recs: Sequence[dict[str, Any]]) -> list[str]:
    mib = 1024**2
    out = [
        "Multi-rank memory: each rank's `torch.cuda.memory_allocated()` (the allocator, not zerorun's report;"
        " on CPU a census of live tensors) after the last step's backward, against the ZeRO formula"
        " (docs/architecture.md Contract 4). Within 5 % means inside [formula, formula + the buffers the config"
        " allows] widened by 5 % (config arithmetic only: what zerorun reports about itself is not used; older"
        " records used it).",
        "",
        "| configuration | status | ranks (per GPU) | measured by | formula MiB | + buffers MiB"
        " | measured MiB (min–max) | vs formula | outside band | within 5 % | host: formula / census MiB |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in recs:
        if r.get("status") != "ok":
            out.append(f"| {_label(r)} | {r.get('status')} |" + " – |" * 9)
            continue
        check = (r.get("checks") or {}).get(str(r.get("checked_point")), {})
        host = r.get("host_census_at_check") or []
        host_txt = (
            f"{_f(r.get('host_formula_bytes'), ',.1f', mib)} / {max(host) / mib:,.1f}"
            if host and r.get("measured_by") == "cuda_allocator"
            else "–"
        )
        measured = check.get("measured_per_rank") or []
        rng = f"{min(measured) / mib:,.1f}–{max(measured) / mib:,.1f}" if measured else "–"
        vs = check.get("deviation_from_formula_per_rank") or []
        vs_txt = f"{min(vs):+.1%}…{max(vs):+.1%}" if vs else "–"
        dev = check.get("max_abs_deviation")
        ok = r.get("within_tolerance")
        out.append(
            f"| {_label(r)} | ok | {r.get('world_size')} ({r.get('ranks_per_gpu')}) | {r.get('measured_by', '–')} | "
            f"{_f(r.get('device_formula_bytes', r['formula_bytes']['gpu']['total']), ',.1f', mib)} | {_f(r.get('buffer_allowance_bytes'), ',.1f', mib)} | "
            f"{rng} | {vs_txt} | {_f(dev, '.1%') if dev is not None else '–'} | "
            f"{'–' if ok is None else ('✓' if ok else '✗')} | {host_txt} |"
        )
    return out


def render(
    records: Sequence[dict[str, Any]], loss_rtol: float = 0.01, largest: Sequence[dict[str, Any]] = ()
) -> str:
    """The whole RESULTS.md: the newest run first; then the largest-model search's own section
    (`largest`: its JSON-lines records, benchmarks/largest_model.py)."""
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        runs[str(r.get("run_id"))].append(r)
    multi_gpu = any(
        int(r.get("world_size") or 1) > 1 and r.get("device") == "cuda" and r.get("status") == "ok"
        for r in records
    )
    out = [
        "# Benchmark results",
        "",
        "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json` — do not edit by hand.",
        "How to run and what each column means: [README.md](README.md).",
        "",
    ]
    if not multi_gpu:
        out += [
            "> Only single-GPU (or CPU) runs so far: world size > 1 on NCCL (DDP, multi-GPU ZeRO) is not yet"
            " measured because one GPU is lent at a time. The harness runs it unchanged (`--nproc N`).",
            "",
        ]
    if not runs:
        out.append("No results yet.")
    for run_id in sorted(runs, reverse=True):
        out += [render_run(runs[run_id], loss_rtol), ""]
    if largest:
        out += render_section(largest)
    return "\n".join(out).rstrip() + "\n"


def console_table(records: Sequence[dict[str, Any]]) -> str:
    """A short plain-text table for the end of a run's log."""
    base_tps, band, _ = baseline(records)
    rows = [("config", "status", "tok/s/GPU", "step ms", "peak GiB", "loss", "x plain")]
    for r in sorted(records, key=_sort_key):
        if r.get("mode") == "memory":
            dev = (r.get("checks") or {}).get(str(r.get("checked_point")), {}).get("max_abs_deviation")
            rows.append((f"mem:{_label(r)}", str(r.get("status")), "", "", "", "", f"dev {_f(dev, '.1%')}"))
            continue
        ok = _ok(r)
        tps = float(r["tokens_per_s_per_gpu"]) if ok else None
        rows.append(
            (
                _label(r),
                str(r.get("status")),
                _f(tps, ",.0f"),
                _f(r.get("step_time_median_s"), ".1f", 1e-3),
                _f(r.get("gpu_mem_peak_allocated_bytes"), ".1f", GIB),
                _f(r.get("final_loss"), ".4f"),
                _f(tps / base_tps if tps and base_tps else None, ".2f"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if band is not None:
        lines.append(f"noise band (plain x2): {band:.1%}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--results", type=Path, action="append", help="record files or dirs (default benchmarks/results)"
    )
    p.add_argument("--out", type=Path, default=here / "RESULTS.md", help="markdown to write ('-' for stdout)")
    p.add_argument(
        "--import-bundle",
        type=Path,
        action="append",
        default=[],
        help="JSON-lines bundle to split into --results first",
    )
    p.add_argument("--loss-rtol", type=float, default=0.01)
    p.add_argument(
        "--largest-model",
        type=Path,
        action="append",
        help="largest-model search results (default benchmarks/results/largest_model)",
    )
    p.add_argument("--print", action="store_true", help="also print the short console table")
    a = p.parse_args(argv)
    dirs = a.results or [here / "results"]
    for bundle in a.import_bundle:
        written = import_bundle(bundle, dirs[0])
        print(f"imported {len(written)} records from {bundle} into {dirs[0]}")
    records = load_records(dirs)
    text = render(records, a.loss_rtol, load_largest(a.largest_model or [LARGEST_DIR]))
    if str(a.out) == "-":
        sys.stdout.write(text)
    else:
        a.out.write_text(text, encoding="utf-8")
        print(f"wrote {a.out} ({len(records)} records)")
    if a.print:
        print(console_table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
