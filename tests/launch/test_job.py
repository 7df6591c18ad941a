"""launch/job.py: the pipeline as a library call (what the CLI, a restart loop or another front end
uses): plan_job starts nothing; run_job runs one job and returns its JobResult."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zerorun.launch.job import plan_job, run_job
from zerorun.launch.plan import LaunchOptions, Target

REPO = Path(__file__).resolve().parents[2]


def test_plan_job_merges_the_config_and_starts_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    marker = tmp_path / "STARTED"
    (tmp_path / "train.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tmp_path / "job.yaml").write_text(
        "train_micro_batch_size_per_gpu: 1\nlauncher:\n  num_gpus: 3\n  device: cpu\n  log_dir: logs\n"
    )
    job = plan_job(LaunchOptions(target=Target(script="train.py"), config="job.yaml", ranks="1"))
    assert (job.plan.world_size, job.plan.device, job.plan.backend) == (3, "cpu", "gloo")
    assert job.options.log_dir == str(tmp_path / "logs")  # relative to the config file
    assert job.rank_filter == {1} and job.withheld == () and not job.multinode
    assert json.loads(job.plan.config_json or "{}")["train_micro_batch_size_per_gpu"] == 1
    assert not marker.exists() and not (tmp_path / "logs").exists()
    with pytest.raises(ValueError, match="plan_job"):
        run_job(LaunchOptions(target=Target(script="train.py"), dry_run=True))


def test_run_job_twice_from_a_library_caller(tmp_path: Path) -> None:
    """A restart is another call: the first run's rank 1 fails, the second run succeeds; each
    call returns its own JobResult and renders to the console it was given."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        print("rank", os.environ["RANK"], "port", os.environ["MASTER_PORT"])
        marker = {str(tmp_path / "failed-once")!r}
        if os.environ["RANK"] == "1" and not os.path.exists(marker):
            open(marker, "w").close()
            sys.exit(3)
    """))
    driver = textwrap.dedent("""
        import io, json, sys
        from zerorun.launch.console import PlainConsole
        from zerorun.launch.job import run_job
        from zerorun.launch.plan import LaunchOptions, Target

        options = LaunchOptions(target=Target(script=sys.argv[1]), num_gpus=2, device="cpu")
        runs = []
        for _ in range(2):
            out = io.StringIO()
            result = run_job(options, PlainConsole(out=out, err=io.StringIO()))
            runs.append({"exit_code": result.exit_code, "reason": result.reason, "first_failure": result.first_failure,
                         "returncodes": [s.returncode for s in result.ranks], "out": out.getvalue()})
        print(json.dumps(runs))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", driver, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = json.loads(proc.stdout.splitlines()[-1])
    assert (first["exit_code"], first["reason"], first["first_failure"]) == (3, "rank_failed", 1)
    assert (second["exit_code"], second["reason"], second["returncodes"]) == (0, "ok", [0, 0])
    assert "[0] rank 0 port" in second["out"] and "[1] rank 1 port" in second["out"]
