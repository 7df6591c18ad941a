"""The launch command in-process: every bad input is a clear message, a non-zero exit, no
traceback and nothing started; `--dry-run` prints the plan (no ranks are started here)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from zerorun.cli import launch_cmd


def _launch(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        launch_cmd.app(args)
    out, err = capsys.readouterr()
    code = info.value.code if isinstance(info.value.code, int) else 1
    return code, out, err


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A script that leaves a marker if it ever runs, in a clean working directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'STARTED')!r}, 'w').close()\n")
    return script


def _bad(args: list[str], capsys: pytest.CaptureFixture[str], job: Path, *needles: str) -> str:
    code, out, err = _launch(args, capsys)
    text = out + err
    assert code != 0, text
    assert "Traceback" not in text, text
    for needle in needles:
        assert needle in " ".join(text.split()), text
    assert not (job.parent / "STARTED").exists()
    return text


def test_script_not_found(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _bad(["nope.py"], capsys, job, "script nope.py not found")
    _bad(["train"], capsys, job, "Did you mean train.py?")
    _bad(["mypkg.train"], capsys, job, "-m mypkg.train")


def test_not_a_python_file(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (job.parent / "run.sh").write_text("#!/bin/bash\necho hi\n")
    _bad(["run.sh"], capsys, job, "run.sh is not a Python file")
    (job.parent / "broken.py").write_text("import os\ndef f(:\n    pass\n")
    _bad(["broken.py"], capsys, job, "broken.py:2", "invalid syntax", "no rank was started", "def f(:")
    (job.parent / "adir").mkdir()
    _bad(["adir"], capsys, job, "adir is a directory without __main__.py")


def test_module_not_importable(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _bad(["-m", "no_such_module_zr"], capsys, job, "no module named 'no_such_module_zr'")
    (job.parent / "pkg").mkdir()
    (job.parent / "pkg" / "__init__.py").write_text("raise SystemExit('package code must not run in the launcher')")
    _bad(["-m", "pkg.missing"], capsys, job, "no module named 'pkg.missing'")
    _bad(["-m", "not-a.name"], capsys, job, "not a module name")
    _bad(["--module", "no_such_module_zr", "--x"], capsys, job, "no module named 'no_such_module_zr'")


def test_missing_config(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _bad(["--config", "nope.yaml", "train.py"], capsys, job, "config file nope.yaml (from --config) does not exist")
    _bad(["train.py", "--deepspeed", "ds.json"], capsys, job, "config file ds.json (from the script's --deepspeed argument)")


def test_too_many_gpus_and_device_errors(job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    _bad(["--device", "cuda", "--num_gpus", "3", "train.py"], capsys, job, "--num_gpus 3 asks for more ranks", "2 visible GPU(s)")
    _bad(
        ["--device", "cuda", "--ranks_per_gpu", "2", "--num_gpus", "5", "train.py"],
        capsys, job, "2 visible GPU(s) x --ranks_per_gpu 2 = 4",
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    _bad(["--device", "cuda", "train.py"], capsys, job, "no GPU is visible (CUDA_VISIBLE_DEVICES is empty)")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    _bad(["--device", "cpu", "--ranks_per_gpu", "2", "train.py"], capsys, job, "--ranks_per_gpu 2 needs GPUs")
    _bad(["--device", "tpu", "train.py"], capsys, job, "'tpu' is not one of auto, cuda, cpu")
    _bad(["--num_gpus", "2", "--nproc_per_node", "3", "train.py"], capsys, job, "disagree")
    _bad(["--num_gpus", "0", "train.py"], capsys, job, "--num-gpus")


def test_invalid_selectors(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _bad(["--include", "localhost:5", "train.py"], capsys, job, "slot(s) 5 of host 'localhost' do not exist")
    _bad(["--include", "localhost:a", "train.py"], capsys, job, "'a' is not a slot index")
    _bad(["--include", "node7", "train.py"], capsys, job, "'node7', which is not in this machine")
    _bad(["--include", "localhost", "--exclude", "localhost:0", "train.py"], capsys, job, "cannot be used together")
    _bad(["--ranks", "5", "train.py"], capsys, job, "--ranks '5' names rank(s) 5")
    _bad(["--num_nodes", "2", "train.py"], capsys, job, "--num_nodes 2 needs --hostfile")


def test_log_dir_not_creatable(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (job.parent / "afile").write_text("")
    _bad(["--log_dir", "afile/logs", "train.py"], capsys, job, "--log_dir afile/logs: cannot create the directory")


def test_busy_port(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        _bad(["--master_port", str(port), "train.py"], capsys, job, f"--master_port {port} is already in use")


def test_usage_errors(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _bad(["--no-such-option", "train.py"], capsys, job, "No such option")
    _bad(["-m"], capsys, job)
    _bad(["--num_gpus", "2"], capsys, job, "SCRIPT")


def test_help_version_and_both_spellings(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _launch(["--help"], capsys)
    assert code == 0
    for name in ("print-config", "estimate", "--num-gpus", "--nproc-per-node", "--hostfile", "--ranks-per-gpu"):
        assert name in out
    code, out, _ = _launch(["--version"], capsys)
    assert code == 0 and out.startswith("zerorun ")
    assert launch_cmd.normalize_argv(["--num_gpus", "2", "--log_dir=x", "t.py", "--num_gpus", "3"]) == [
        "--num-gpus", "2", "--log-dir=x", "--", "t.py", "--num_gpus", "3",
    ]
    assert launch_cmd.normalize_argv(["--dry_run", "-m", "pkg.mod", "--dry_run"]) == [
        "--dry-run", "-m", "pkg.mod", "--", "--dry_run",
    ]
    assert launch_cmd.normalize_argv(["-mpkg", "x"]) == ["-m", "pkg", "--", "x"]
    # an unknown underscore option is left alone (click then names it)
    assert launch_cmd.normalize_argv(["--foo_bar", "t.py"]) == ["--foo_bar", "--", "t.py"]


def _table(out: str) -> list[list[str]]:
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("rank "))
    rows = []
    for ln in lines[start + 1 :]:
        if not ln[:1].isdigit():
            break
        rows.append(ln.split())
    return rows


def test_dry_run_cpu(job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    code, out, err = _launch(
        ["--dry-run", "--num_gpus", "3", "--env", "MY_API_TOKEN=hunter22", "--env", "NCCL_DEBUG=INFO",
         "--master_port", "29123", "train.py", "--lr", "1"],
        capsys,
    )
    assert code == 0, err
    assert not (job.parent / "STARTED").exists()
    cores = len(os.sched_getaffinity(0))
    omp = str(max(1, cores // 3))
    assert _table(out) == [[str(r), str(r), "0", "localhost", "cpu", "-", omp] for r in range(3)]
    assert "3 rank(s), 1 node(s), device cpu, backend gloo, master 127.0.0.1:29123" in out
    for line in ("MASTER_ADDR=127.0.0.1", "MASTER_PORT=29123", "WORLD_SIZE=3", "ZERORUN_BACKEND=gloo",
                 "ZERORUN_DEVICE=cpu", "ZERORUN_PG_TIMEOUT=600", "MY_API_TOKEN=<redacted>", "NCCL_DEBUG=INFO"):
        assert f"  {line}\n" in out
    assert "hunter22" not in out
    assert "zerorun.shim train.py --lr 1" in out


def test_dry_run_ranks_per_gpu_mapping(job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # CUDA_VISIBLE_DEVICES in UUID form: slot i is the i-th entry, passed on verbatim.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaa,GPU-bbb,GPU-ccc")
    code, out, err = _launch(
        ["--dry-run", "--device", "cuda", "--ranks_per_gpu", "2", "--include", "localhost:1,2", "train.py"], capsys
    )
    assert code == 0, err
    rows = _table(out)
    assert [(r[0], r[1], r[4], r[5]) for r in rows] == [
        ("0", "0", "cuda:0", "GPU-bbb,GPU-ccc"),
        ("1", "1", "cuda:0", "GPU-bbb,GPU-ccc"),
        ("2", "2", "cuda:1", "GPU-bbb,GPU-ccc"),
        ("3", "3", "cuda:1", "GPU-bbb,GPU-ccc"),
    ]
    assert "backend gloo" in out and "ZERORUN_RANKS_PER_GPU=2" in out

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    code, out, err = _launch(["--dry_run", "--device", "cuda", "--num_gpus", "3", "--ranks-per-gpu", "2", "train.py"], capsys)
    assert code == 0, err
    assert [(r[4], r[5]) for r in _table(out)] == [("cuda:0", "4,5"), ("cuda:0", "4,5"), ("cuda:1", "4,5")]

    code, out, err = _launch(["--dry-run", "--device", "cuda", "--exclude", "localhost:0", "train.py"], capsys)
    assert code == 0, err
    assert [(r[4], r[5]) for r in _table(out)] == [("cuda:0", "5")]
    assert "backend nccl" in out


def test_invalid_config_starts_nothing(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = job.parent / "ds.json"
    bad.write_text('{"zero_optimisation": {"stage": 2}}')
    _bad(["train.py", "--deepspeed", "ds.json"], capsys, job, "zero_optimisation", "zero_optimization")
    _bad(["--config", "ds.json", "train.py"], capsys, job, "zero_optimisation")
    # The batch triad is checked against the planned world size before anything starts.
    bad.write_text('{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}')
    _bad(["--num_gpus", "2", "train.py", "--deepspeed_config", "ds.json"], capsys, job, "10")


def test_config_launcher_section_merges_under_the_command_line(
    job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = job.parent / "job.yaml"
    cfg.write_text(
        "zero_optimization: {stage: 1}\n"
        "launcher:\n  num_gpus: 3\n  master_port: 29444\n  env: {FOO_FROM_CONFIG: yes-1}\n"
    )
    code, out, err = _launch(["--dry-run", "--config", "job.yaml", "train.py"], capsys)
    assert code == 0, err
    assert len(_table(out)) == 3 and "MASTER_PORT=29444" in out and "FOO_FROM_CONFIG=yes-1" in out
    assert "ZERORUN_CONFIG=job.yaml" in out and "ZERORUN_CONFIG_JSON=<" in out
    code, out, err = _launch(["--dry-run", "--num_gpus", "1", "--master_port", "29445", "train.py", "--config", "job.yaml"], capsys)
    assert code == 0, err
    assert len(_table(out)) == 1 and "MASTER_PORT=29445" in out


def test_launcher_slurm_outside_an_allocation_reruns_the_given_command_secrets_scrubbed(
    job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The salloc line re-runs the arguments this command got (not the process's sys.argv,
    which is pytest's here, or another program's when zerorun is called as a library), and the
    printed line hides a secret of the environment, as --dry-run does."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_s3cr3tvalue")
    args = ["--launcher", "slurm", "--num_nodes", "2", "--dry-run", "train.py", "--hf_token", "hf_s3cr3tvalue"]
    code, out, err = _launch(args, capsys)
    assert code == 0, err
    line = next(x for x in err.splitlines() if "obtaining one" in x)
    assert "salloc --nodes=2 " in line
    assert line.endswith("-m zerorun --launcher slurm --num_nodes 2 --dry-run train.py --hf_token <redacted>"), line
    assert "hf_s3cr3tvalue" not in out + err


def test_config_launcher_slurm_obtains_the_allocation_like_the_flag(
    job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`launcher: {launcher: slurm, num_nodes: 2}` in the config takes the salloc path as
    `--launcher slurm --num_nodes 2` does; the command line wins over the config; SLURM_JOBID
    alone (the older name) counts as being inside an allocation, as SLURM_JOB_ID does."""
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (job.parent / "job.yaml").write_text("zero_optimization: {stage: 1}\nlauncher: {launcher: slurm, num_nodes: 2}\n")

    def salloc_line(args: list[str]) -> str | None:
        code, out, err = _launch(args, capsys)
        assert code == 0, err
        return next((x for x in err.splitlines() if "obtaining one" in x), None)

    flag = salloc_line(["--launcher", "slurm", "--num_nodes", "2", "--dry-run", "train.py"])
    config = salloc_line(["--dry-run", "--config", "job.yaml", "train.py"])
    assert flag is not None and config is not None
    assert "salloc --nodes=2 " in flag and "salloc --nodes=2 " in config
    assert config.endswith("-m zerorun --dry-run --config job.yaml train.py"), config  # the same command, inside
    # The command line wins: --launcher local (or --num_nodes 3) over the config's values.
    assert salloc_line(["--launcher", "local", "--num_nodes", "1", "--dry-run", "--config", "job.yaml", "train.py"]) is None
    assert "salloc --nodes=3 " in (salloc_line(["--num_nodes", "3", "--dry-run", "--config", "job.yaml", "train.py"]) or "")

    # Inside an allocation known only by SLURM_JOBID: the slurm launcher plans its nodes, no salloc.
    monkeypatch.setenv("SLURM_JOBID", "4711")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-02]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1(x2)")
    for args in (["--launcher", "slurm", "--device", "cpu"], ["--config", "job.yaml", "--device", "cpu"]):
        code, out, err = _launch([*args, "--dry-run", "train.py"], capsys)
        assert code == 0, err
        assert "obtaining one" not in err and "launcher slurm" in err, err
        assert "gpu01" in out and "gpu02" in out, out
    assert not (job.parent / "STARTED").exists()
