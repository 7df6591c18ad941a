"""steps_per_print, wall_clock_breakdown and the monitors, through the real launcher.

One 2-rank CPU job (stage 2, accumulation 2, 5 optimizer steps, a report every 2) serves every
assertion: the DeepSpeed-style stdout lines, the `status` events in the launcher's events file,
the CSV, TensorBoard and W&B files -- each compared with what the training script itself
computed. ZERORUN_TEST_DEVICE=cuda (scripts/gpu_checks.sh) runs the two ranks on one GPU, so the
timers are CUDA events.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.launch import _launch
from zerorun.runtime.observe import PHASES

JOB = Path(__file__).resolve().parent / "_observe_job.py"
STEPS = 5


# CI installs both (pyproject's test extra); the GPU machine's image has neither, and what its
# run checks (scripts/gpu_checks.sh observe_cuda) are the CUDA paths, not the two packages.
HAS_WANDB = importlib.util.find_spec("wandb") is not None
HAS_COMET = importlib.util.find_spec("comet_ml") is not None


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("observe")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
        "gradient_clipping": 1.0,
        "steps_per_print": 2,
        "wall_clock_breakdown": True,
        "csv_monitor": {"enabled": True, "output_path": str(tmp / "csv"), "job_name": "job"},
        "tensorboard": {"enabled": True, "output_path": str(tmp / "tb"), "job_name": "job"},
        "wandb": {"enabled": HAS_WANDB, "project": "zr-test", "group": "g"},
        "comet": {"enabled": HAS_COMET, "online": False, "project": "p", "workspace": "w", "samples_log_interval": 16},
        "activation_checkpointing": {"profile": True},
    }
    cfg_path = tmp / "ds.json"
    cfg_path.write_text(json.dumps(config))
    log_dir = tmp / "logs"
    device = os.environ.get("ZERORUN_TEST_DEVICE", "cpu")
    placement = ["--device", device] + (["--ranks_per_gpu", "2"] if device == "cuda" else [])
    code, out, err, _ = _launch.run(
        ["--num_gpus", "2", *placement, "--config", str(cfg_path), "--log_dir", str(log_dir), str(JOB), str(STEPS)],
        env={
            "ZERORUN_MEMORY_REPORT_INTERVAL": "0.5",  # memory events with the breakdown, for the plot
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "WANDB_DIR": str(tmp),
            "COMET_OFFLINE_DIRECTORY": str(tmp / "comet"),
        },
        timeout=120,
    )
    assert code == 0, out[-3000:] + err[-3000:]
    truth = [json.loads(line.split("TRUTH ", 1)[1]) for line in out.splitlines() if "TRUTH " in line]
    assert [t["step"] for t in truth] == list(range(1, STEPS + 1)), out[-3000:]
    events = [json.loads(line) for line in (log_dir / "events.jsonl").read_text().splitlines()]
    return {"out": out, "truth": truth, "events": events, "tmp": tmp, "log_dir": log_dir}


def test_stdout_lines_like_deepspeed(job: dict[str, Any]) -> None:
    lines = [line for line in job["out"].splitlines() if "[Rank 0] step=" in line]
    assert len(lines) == 2, job["out"][-3000:]  # steps 2 and 4 (step 5 is not a print step)
    by_step = {t["step"]: t for t in job["truth"]}
    for line, step in zip(lines, (2, 4), strict=True):
        assert line.startswith("[0] ")  # printed by rank 0 only, shown by the launcher with its prefix
        fields = dict(re.findall(r"(\w[\w/]*)=([^,]+(?:\([^)]*\))?[^,]*)", line.split("[Rank 0] ", 1)[1]))
        assert int(fields["step"]) == step and int(fields["skipped"]) == 0
        assert float(fields["loss"]) == pytest.approx(by_step[step]["loss"], rel=1e-5)
        assert float(fields["grad_norm"]) == pytest.approx(by_step[step]["grad_norm"], rel=1e-5)
        assert float(fields["lr"].strip("[]")) == pytest.approx(by_step[step]["lr"], rel=1e-5)
        assert float(fields["samples/s"]) > 0 and float(fields["tokens/s"]) > 0
        assert "mom=[(0.9, 0.999)]" in line
    timer_lines = [line for line in job["out"].splitlines() if "[Rank 0] time (ms) |" in line]
    assert len(timer_lines) == 2
    ms = dict(re.findall(r"(\w+): ([0-9.]+)", timer_lines[0]))
    assert set(ms) == set(PHASES)
    # Printed with two decimals like DeepSpeed: a short phase of this tiny model on a GPU prints
    # 0.00 ms; the phases that enclose real work never do.
    assert all(float(v) >= 0 for v in ms.values())
    assert all(float(ms[name]) > 0 for name in ("fwd", "bwd", "step"))
    assert float(ms["step"]) >= float(ms["optimizer_gradients"]) + float(ms["optimizer_step"]) - 0.05
    # bwd encloses its two parts
    assert float(ms["bwd"]) >= float(ms["bwd_inner"]) + float(ms["bwd_allreduce"]) - 0.05
    # activation_checkpointing.profile: 2 steps x 2 micro-batches per report, one checkpoint each
    ck = [line for line in job["out"].splitlines() if "[Rank 0] activation checkpointing" in line]
    assert len(ck) == 2 and all("(4 calls) | recompute:" in line and line.endswith("(4 calls)") for line in ck), ck
    # the launcher's per-rank log has the same line
    assert "[Rank 0] step=2," in (job["log_dir"] / "rank0.log").read_text()


def test_status_events_per_rank(job: dict[str, Any]) -> None:
    reports = [e for e in job["events"] if e.get("kind") == "status" and "samples_per_sec" in e]
    by_rank: dict[int, list[int]] = {}
    for e in reports:
        by_rank.setdefault(e["rank"], []).append(e["step"])
        assert set(e["timers_ms"]) == set(PHASES)
        assert e["samples_per_sec"] > 0 and e["tokens_per_sec"] > 0
    assert by_rank == {0: [2, 4], 1: [2, 4]}  # every rank: the live panel shows a straggler
    truth = {t["step"]: t for t in job["truth"]}
    for e in reports:
        if e["rank"] == 0:
            assert e["loss"] == pytest.approx(truth[e["step"]]["loss"], rel=1e-5)
            assert e["samples"] == truth[e["step"]]["samples"]


def _csv(path: Path) -> tuple[list[str], list[tuple[int, float]]]:
    rows = list(csv.reader(path.open()))
    return rows[0], [(int(r[0]), float(r[1])) for r in rows[1:]]


def test_csv_monitor_has_every_step_with_deepspeed_names(job: dict[str, Any]) -> None:
    d = job["tmp"] / "csv" / "job"
    truth = job["truth"]
    header, rows = _csv(d / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"]
    # x = global samples, one row per optimizer step -- including step 5, after the last print
    assert [s for s, _ in rows] == [t["samples"] for t in truth]
    assert [v for _, v in rows] == pytest.approx([t["loss"] for t in truth], rel=1e-5)
    _, lr = _csv(d / "Train_Samples_lr.csv")
    assert [v for _, v in lr] == pytest.approx([t["lr"] for t in truth], rel=1e-6)
    _, norms = _csv(d / "Train_Samples_grad_norm.csv")
    assert [v for _, v in norms] == pytest.approx([t["grad_norm"] for t in truth], rel=1e-5)
    for name in ("forward", "backward", "backward_inner", "backward_allreduce", "step"):
        _, ms = _csv(d / f"Train_Samples_elapsed_time_ms_{name}.csv")
        assert len(ms) == STEPS and all(v >= 0 for _, v in ms)
    assert not (d / "Train_Samples_loss_scale.csv").exists()  # fp16 only, as in DeepSpeed


def test_tensorboard_scalars(job: dict[str, Any]) -> None:
    from tensorboard.backend.event_processing import event_accumulator as event_acc
    acc = event_acc.EventAccumulator(str(job["tmp"] / "tb" / "job"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/elapsed_time_ms_forward"} <= tags
    loss = acc.Scalars("Train/Samples/train_loss")
    assert [e.step for e in loss] == [t["samples"] for t in job["truth"]]
    assert [e.value for e in loss] == pytest.approx([t["loss"] for t in job["truth"]], rel=1e-5)


def _wandb_history(run_file: Path) -> list[dict[str, float]]:
    """The `history` records of an offline W&B run file (a LevelDB-style log of protobuf
    records after a 7-byte header; 32 KiB blocks, 7-byte record headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, chunks, buf = run_file.read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and n == 0:
            break
        buf += data[pos : pos + n]
        pos += n
        if kind in (1, 4):  # FULL, LAST
            chunks.append(buf)
            buf = b""
    out = []
    for chunk in chunks:
        rec = pb.Record()
        rec.ParseFromString(chunk)
        if rec.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
            out.append({k: float(v) for k, v in items.items() if k.startswith("Train/")} | {"_step": rec.history.step.num})
    return out


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed")
def test_wandb_offline_run_has_every_step(job: dict[str, Any]) -> None:
    files = list((job["tmp"] / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files  # rank 0 only
    history = _wandb_history(files[0])
    assert [h["_step"] for h in history] == [t["samples"] for t in job["truth"]]
    assert [h["Train/Samples/train_loss"] for h in history] == pytest.approx([t["loss"] for t in job["truth"]], rel=1e-5)
    assert [h["Train/Samples/lr"] for h in history] == pytest.approx([t["lr"] for t in job["truth"]], rel=1e-6)


@pytest.mark.skipif(not HAS_COMET, reason="comet-ml is not installed")
def test_comet_offline_experiment_logs_per_samples_log_interval(job: dict[str, Any]) -> None:
    archives = list((job["tmp"] / "comet").glob("*.zip"))
    assert len(archives) == 1, archives  # rank 0 only
    with zipfile.ZipFile(archives[0]) as z:
        messages = [json.loads(line) for line in z.read("messages.json").decode().splitlines() if line.strip()]
    loss = [
        (m["payload"]["metric"]["step"], m["payload"]["metric"]["metricValue"])
        for m in messages
        if m.get("type") == "metric_msg" and m["payload"]["metric"]["metricName"] == "Train/Samples/train_loss"
    ]
    # 8 samples per step; each tag at most once per 16 samples (DeepSpeed's comet scheduling)
    truth = {t["samples"]: t["loss"] for t in job["truth"]}
    assert [s for s, _ in loss] == [8, 24, 40]
    assert [float(v) for _, v in loss] == pytest.approx([truth[s] for s, _ in loss], rel=1e-5)


def test_zerorun_plot_reads_the_log_dir_and_the_csv_monitor(job: dict[str, Any], tmp_path: Path) -> None:
    from zerorun.plot import read_run

    run = read_run(job["log_dir"])
    truth = {t["step"]: t for t in job["truth"]}
    printed = dict(run.loss)
    assert {2.0, 4.0} <= set(printed)
    for step in (2, 4):
        assert printed[float(step)] == pytest.approx(truth[step]["loss"], rel=1e-5)
    assert sorted(run.timers) == [0, 1] and set(run.memory) == {0, 1} and run.breakdown[0]["params"] > 0
    assert run.throughput_label == "tokens/s" and all(v > 0 for _, v in run.throughput)
    csv_run = read_run(job["tmp"] / "csv")  # the parent of job_name is enough
    assert [v for _, v in csv_run.loss] == pytest.approx([t["loss"] for t in job["truth"]], rel=1e-5)
    for source in (job["log_dir"], job["tmp"] / "csv" / "job"):
        png = tmp_path / f"{source.name}.png"
        proc = subprocess.run(
            [sys.executable, "-m", "zerorun", "plot", str(source), "-o", str(png)],
            cwd=_launch.REPO, capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_plot_errors_are_messages_and_the_launcher_imports_neither_torch_nor_matplotlib(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "zerorun", "plot", str(tmp_path), "-o", str(tmp_path / "x.png")],
        cwd=_launch.REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0 and "has neither events.jsonl" in " ".join((proc.stdout + proc.stderr).split())
    assert "Traceback" not in proc.stdout + proc.stderr
    probe = (
        "import sys\nfrom zerorun.cli import main\n"
        "for argv in (['--help'], ['plot', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules, sorted(m for m in sys.modules if m.startswith(('torch', 'matplotlib')))[:5]\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=_launch.REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
