"""The largest-model search (benchmarks/largest_model.py): shapes, the prediction from
`zerorun estimate`, the memory watch that kills a try, the summary's limiting resource, and one
search end to end on CPU with tiny sizes (real child processes, cpu and nvme optimizer offload)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import largest_model as lm  # noqa: E402
from benchmarks import largest_model_report as lmr  # noqa: E402
from benchmarks import report  # noqa: E402
from benchmarks.workload import gpt_model  # noqa: E402

GIB = lm.GIB


def test_shapes_count_like_the_model_and_scale_hidden_and_layers() -> None:
    for target in (3e7, 1.3e9, 5.5e9, 2e10):
        s = lm.shape_for(target, 32000, 2048)
        assert s is not None and s.params <= target and s.layers >= max(2, s.hidden // 256)
        cfg = gpt_model.GPTConfig(
            n_layer=s.layers, d_model=s.hidden, n_head=s.heads, vocab_size=32000, seq_len=2048
        )
        assert s.params == gpt_model.count_parameters(cfg)
        up = lm.step(s, 1)
        assert up is not None and up.hidden == s.hidden and up.layers > s.layers
    # Bigger budgets get wider models, not only deeper ones.
    assert lm.shape_for(5.5e9, 32000, 2048).hidden > lm.shape_for(1.3e9, 32000, 2048).hidden  # type: ignore[union-attr]
    assert lm.shape_for(10, 32000, 2048) is None


def test_prediction_is_the_estimate_and_binds_on_the_right_resource() -> None:
    host = lm.Limits(
        host_bytes=120 * GIB, host_overhead=6 * GIB, gpu_bytes=139 * GIB, disk_bytes=float("inf")
    )
    shape, limit = lm.largest_predicted("cpu", 32000, 2048, 4, 50_000_000, host, 22, None)
    assert shape is not None and limit == "host RAM"
    p = lm.predict(shape, "cpu", 4, 50_000_000, host, 22)
    # stage 3, parameters and optimizer on the host: 2 + 4 + 8 + 4 = 18 bytes per parameter
    assert p["host_bytes"] == pytest.approx(18 * shape.params + 6 * GIB)
    assert p["fits"] and not lm.predict(lm.step(shape, 1), "cpu", 4, 50_000_000, host, 22)["fits"]  # type: ignore[arg-type]
    assert 6e9 < shape.params <= 114 * GIB / 18  # (120 - 6) GiB / 18 B
    # NVMe: the disk holds 12 B/param; with a small disk the disk binds, with a slow one the time.
    small_disk = lm.Limits(host_bytes=120 * GIB, host_overhead=6 * GIB, gpu_bytes=139 * GIB, disk_bytes=30 * GIB,
                           disk_read_bps=2e9, disk_write_bps=2e9)  # fmt: skip
    shape, limit = lm.largest_predicted("nvme", 32000, 2048, 4, 50_000_000, small_disk, 22, None)
    assert limit == "disk" and 12 * shape.params <= 30 * GIB  # type: ignore[union-attr]
    timed, limit = lm.largest_predicted("nvme", 32000, 2048, 4, 50_000_000, small_disk, 22, 100.0)
    assert limit == "the call's time (disk speed)" and timed.params < shape.params  # type: ignore[union-attr]
    assert lm.predict(timed, "nvme", 4, 50_000_000, small_disk, 22)["io_seconds"] <= 100.0  # type: ignore[arg-type]


def test_a_try_is_killed_when_host_memory_runs_low() -> None:
    """The watch (not the kernel's OOM killer) stops a try; the record names host RAM."""
    rec = lm.run_try(lm.Shape(2, 64, 512, 64), "cpu", micro_batch=2, steps=22, warmup=2, sub_group=4096,
                     nvme_path=None, timeout_s=60, min_available=1 << 62)  # fmt: skip
    assert rec["status"] == "host_oom" and rec["limit"] == "host RAM" and rec["wall_s"] < 30


def _try(mode: str, layers: int, status: str, limit: str | None = None) -> dict:
    shape = lm.Shape(layers, 4096, 32000, 2048)
    return {"run_id": "r", "kind": "try", "mode": mode, "layers": layers, "hidden": 4096, "params": shape.params,
            "status": status, "limit": limit, "wall_s": 100.0, "steps_done": 22 if status == "ok" else 3,
            "predicted": {"host_bytes": 1e11, "disk_bytes": 0.0}, "result": None}  # fmt: skip


def test_summary_names_what_stopped_the_next_step_up() -> None:
    recs = [
        {"run_id": "r", "kind": "search", "mode": "cpu", "predicted": {"next_step_limited_by": "host RAM"}},
        _try("cpu", 26, "ok"),
        _try("cpu", 29, "host_oom", "host RAM"),
        {"run_id": "r", "kind": "search", "mode": "nvme", "predicted": {"next_step_limited_by": "disk"}},
        _try("nvme", 10, "ok"),
    ]
    cpu, nvme = lmr.mode_summary(recs, "cpu"), lmr.mode_summary(recs, "nvme")
    assert cpu["best"]["layers"] == 26 and cpu["limit"] == "host RAM (6.11B: host_oom)"  # type: ignore[index]
    assert nvme["limit"] == "disk (predicted; the next step up was not tried)"  # type: ignore[index]
    # A search cut short after a successful step up: the next size's estimate and why it stopped.
    nxt = {"params": 7.55e9, "binding": "host RAM", "use": {"host RAM": 1.19, "GPU memory": 0.2}}
    cut = [
        *recs[:2],
        {"run_id": "r", "kind": "search_end", "mode": "cpu", "reason": "the call's time", "next": nxt},
    ]
    assert lmr.mode_summary(cut, "cpu")["limit"] == (  # type: ignore[index]
        "host RAM (predicted: 7.55B needs 119% of it; not tried: the call's time)"
    )
    failed_first = lmr.mode_summary([_try("cpu", 29, "gpu_oom", "GPU memory")], "cpu")
    assert failed_first["best"] is None and failed_first["limit"].startswith("GPU memory")  # type: ignore[index]


def test_search_end_to_end_on_cpu(tmp_path: Path) -> None:
    """One real search per mode (tiny sizes, a 4 MB host budget), then the RESULTS.md section:
    each mode trained >= 20 steps with a falling loss, and the estimate matches the measured
    model states within 5 %."""
    out, nvme = tmp_path / "largest.jsonl", tmp_path / "nvme"
    nvme.mkdir()
    cmd = [sys.executable, "-m", "benchmarks.largest_model", "run", "--budget-s", "200", "--max-tries", "1",
           "--vocab", "512", "--seq", "64", "--micro-batch", "2", "--sub-group", "4096", "--host-budget-gb", "0.004",
           "--host-overhead-gb", "0", "--nvme-path", str(nvme), "--disk-probe-mib", "8", "--min-try-s", "1",
           "--out", str(out)]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    tries = [r for r in recs if r["kind"] == "try"]
    ends = [r for r in recs if r["kind"] == "search_end"]
    assert [(e["mode"], e["reason"]) for e in ends] == [
        ("cpu", "--max-tries 1"),
        ("nvme", "--max-tries 1"),
    ], ends
    assert all(e["next"]["params"] > t["params"] for e, t in zip(ends, tries, strict=True))
    assert [t["mode"] for t in tries] == ["cpu", "nvme"] and all(t["status"] == "ok" for t in tries), tries
    for t in tries:
        assert t["result"]["steps"] >= 20 and t["result"]["falling"]
        mm = lmr.measured(t)
        assert abs(mm["deviation"]) <= 0.05, mm
    assert 17.5 <= lmr.measured(tries[0])["host_bytes_per_param"] <= 19  # 18 B/param + small tensors
    assert list(nvme.iterdir()) == []  # the search's NVMe files are gone
    md = report.render([], largest=recs)
    section = md[md.index("## Largest model on one GPU") :]
    rows = [x for x in section.splitlines() if x.startswith("| cpu |") or x.startswith("| nvme |")]
    assert len(rows) == 2 and all("✓ |" in x for x in rows), rows
    assert "host RAM (predicted" in rows[0]
    # Start-up apart from training: initialize's host peak for each mode's largest size.
    startup = [x for x in section.splitlines() if "host peak RSS during initialize" in x]
    assert [x.split(":")[0] for x in startup] == ["- cpu", "- nvme"], section
    for t in tries:
        res = t["result"]
        assert 0 < res["host_rss_before_init_bytes"] <= res["host_peak_init_bytes"], res
        assert res["host_peak_training_bytes"] > 0
        assert res["gpu_init_growth_bytes"] is None  # CPU: no GPU figures
