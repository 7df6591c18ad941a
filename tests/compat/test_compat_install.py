"""`zerorun compat install | uninstall | status` in a throwaway virtual environment (this
checkout and the test environment's packages reached through a .pth file): afterwards every
Python started there -- also a child process -- gets zerorun's layer for `import deepspeed`,
`pip list` shows it, the `deepspeed` command runs a DeepSpeed script through zerorun's launcher,
and `pip uninstall deepspeed` / `zerorun compat uninstall` remove exactly what was written. A
real DeepSpeed in the environment makes install refuse. Plus the launcher-option mapping."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from zerorun.compat.launcher_args import LauncherArgsError, translate

from ._run import ROOT, env


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    site = next((path / "lib").glob("python*/site-packages"))
    (site / "zz_test_paths.pth").write_text(f"{ROOT}\n{sysconfig.get_paths()['purelib']}\n")
    return path


def _py(venv: Path, *args: str, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess[str]:
    e = env(**extra)
    e.pop("PYTHONPATH", None)  # only what the environment itself provides
    return subprocess.run([str(venv / "bin" / "python"), *args], env=e, capture_output=True, text=True,
                          timeout=timeout, cwd=venv)


PROBE = (
    "import importlib.metadata as m, subprocess, sys, deepspeed\n"
    "child = subprocess.run([sys.executable, '-c', 'import deepspeed; print(deepspeed.__name__)'], capture_output=True, text=True)\n"
    "print(deepspeed.__name__, m.version('deepspeed'), child.stdout.strip())\n"
)


def test_install_status_command_and_uninstall(venv: Path, tmp_path: Path) -> None:
    assert _py(venv, "-c", "import deepspeed").returncode != 0  # nothing yet
    done = _py(venv, "-m", "zerorun", "compat", "install")
    assert done.returncode == 0, done.stderr
    assert "pip list shows `deepspeed 0.16.4+zerorun`" in done.stdout
    probe = _py(venv, "-c", PROBE)
    assert probe.stdout.split() == ["zerorun.compat.deepspeed", "0.16.4+zerorun", "zerorun.compat.deepspeed"], probe.stderr
    assert "installed (0.16.4+zerorun" in _py(venv, "-m", "zerorun", "compat", "status").stdout
    listed = _py(venv, "-m", "pip", "list", "--format=freeze", timeout=180)
    if listed.returncode == 0:  # pip from the test environment, through the .pth
        assert "deepspeed==0.16.4+zerorun" in listed.stdout.splitlines()
    # The `deepspeed` command: DeepSpeed's launcher options, zerorun's launcher, the layer in the ranks.
    script = tmp_path / "train.py"
    script.write_text(
        "import argparse, os, deepspeed\n"
        "p = argparse.ArgumentParser(); p.add_argument('--local_rank', type=int); p.add_argument('--x')\n"
        "a = p.parse_args()\n"
        "print('RANK', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], a.local_rank, a.x, deepspeed.__name__)\n"
    )
    ran = subprocess.run([str(venv / "bin" / "deepspeed"), "--num_gpus", "2", "--master_port=29731", str(script),
                          "--x", "y"], env={**env(), "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
                         timeout=180, cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    for rank in (0, 1):
        assert f"RANK {rank} of 2 {rank} y zerorun.compat.deepspeed" in ran.stdout
    refused = subprocess.run([str(venv / "bin" / "deepspeed"), "--no_python", str(script)],
                             env=env(), capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--no_python is not supported by zerorun: zerorun runs Python" in refused.stderr
    gone = _py(venv, "-m", "zerorun", "compat", "uninstall")
    assert gone.returncode == 0 and "removed from" in gone.stdout
    assert _py(venv, "-c", "import deepspeed").returncode != 0
    assert not (venv / "bin" / "deepspeed").exists()
    assert "not installed" in _py(venv, "-m", "zerorun", "compat", "status").stdout
    if listed.returncode == 0:  # `pip uninstall deepspeed` removes it just as well
        assert _py(venv, "-m", "zerorun", "compat", "install").returncode == 0
        out = _py(venv, "-m", "pip", "uninstall", "-y", "deepspeed", timeout=180)
        assert "Successfully uninstalled deepspeed-0.16.4+zerorun" in out.stdout, out.stderr
        assert _py(venv, "-c", "import deepspeed").returncode != 0
        assert not (venv / "bin" / "deepspeed").exists()


def test_install_refuses_next_to_a_real_deepspeed(venv: Path) -> None:
    site = next((venv / "lib").glob("python*/site-packages"))
    info = site / "deepspeed-0.19.8.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n")
    (info / "INSTALLER").write_text("pip\n")
    try:
        got = _py(venv, "-m", "zerorun", "compat", "install")
        said = " ".join(got.stderr.split())  # the message is wrapped to the terminal width
        assert got.returncode == 1
        assert "a real DeepSpeed 0.19.8 is installed" in said and "`pip uninstall deepspeed` first" in said
        assert "real DeepSpeed: 0.19.8" in _py(venv, "-m", "zerorun", "compat", "status").stdout
    finally:
        for f in info.iterdir():
            f.unlink()
        info.rmdir()


def test_install_refuses_outside_a_virtual_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from zerorun.compat import venv_install

    monkeypatch.setattr(sys, "prefix", sys.base_prefix)
    with pytest.raises(venv_install.InstallError, match="not in a virtual environment"):
        venv_install.install()


def test_deepspeed_launcher_options_map_onto_zeroruns() -> None:
    args, notes = translate(["--hostfile", "hf", "--include=w1:0,1", "--num_gpus", "4", "--num_nodes", "2",
                             "--master_port", "29600", "--master_addr", "10.0.0.1", "--no_local_rank",
                             "train.py", "--deepspeed", "ds.json", "--num_gpus", "9"])
    assert args == ["--deepspeed-compat", "--hostfile", "hf", "--include", "w1:0,1", "--num_gpus", "4",
                    "--num_nodes", "2", "--master_port", "29600", "--master_addr", "10.0.0.1", "--no_local_rank",
                    "train.py", "--deepspeed", "ds.json", "--num_gpus", "9"]  # the script's own args untouched
    assert notes == []
    args, _ = translate(["--launcher", "openmpi", "--launcher_args", "-x FOO", "--module", "pkg.train"])
    assert args == ["--deepspeed-compat", "--module", "--launcher", "mpi", "--mpi-args", "-x FOO", "pkg.train"]
    assert translate(["--launcher=slurm", "--launcher_args=--time 1:00:00", "t.py"])[0][-4:] == [
        "slurm", "--slurm-args", "--time 1:00:00", "t.py"]
    assert translate(["--num-gpus=2", "t.py"])[0] == ["--deepspeed-compat", "--num_gpus", "2", "t.py"]
    assert translate(["--force_multi", "t.py"])[1]  # said, not silently dropped
    for bad, why in (("--launcher=mvapich", "not supported"), ("--autotuning", "autotuner"),
                     ("--bogus", "not one zerorun maps")):
        with pytest.raises(LauncherArgsError, match=why):
            translate([bad, "t.py"])
    with pytest.raises(LauncherArgsError, match="no script"):
        translate(["--num_gpus", "2"])


def test_deepspeed_short_options_and_ssh_port_map_onto_zeroruns() -> None:
    # DeepSpeed's runner: -H/--hostfile, -i/--include, -e/--exclude (argparse: "-H f" or "-Hf"), --ssh_port.
    args, notes = translate(["-H", "hf", "-i", "w1:0,1@w2", "--ssh_port", "2222", "train.py", "-i", "x", "-H", "y"])
    assert args == ["--deepspeed-compat", "--hostfile", "hf", "--include", "w1:0,1@w2", "--ssh_port", "2222",
                    "train.py", "-i", "x", "-H", "y"] and notes == []  # the script's own -i/-H untouched
    assert translate(["-Hhf", "-e=w1:3", "--ssh_port=22", "t.py"])[0] == [
        "--deepspeed-compat", "--hostfile", "hf", "--exclude", "w1:3", "--ssh_port", "22", "t.py"]
    with pytest.raises(LauncherArgsError, match="-e needs a value|--exclude needs a value"):
        translate(["-e"])


def test_deepspeed_command_reaches_the_selected_node_on_its_ssh_port(tmp_path: Path) -> None:
    """The `deepspeed` command, as `zerorun compat install` puts it, with DeepSpeed's -H, -i and
    --ssh_port: zerorun's launcher connects to the one node the selector keeps, on that port (9,
    closed here: the refusal names host and port, and nothing starts)."""
    (tmp_path / "hostfile").write_text("nodeA slots=1\n127.0.0.2 slots=1\n")
    (tmp_path / "t.py").write_text("print('started')\n")
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from zerorun.compat.deepspeed_command import main; sys.exit(main())",
         "-H", str(tmp_path / "hostfile"), "-i", "127.0.0.2", "--ssh_port", "9", str(tmp_path / "t.py")],
        cwd=ROOT, env=env(ZERORUN_SSH_CONNECT_TIMEOUT="2"), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0 and "started" not in proc.stdout
    assert "127.0.0.2 (127.0.0.2:9)" in proc.stderr, proc.stderr  # the port given, not 22
    assert "nodeA" not in proc.stderr and "Nothing was started" in proc.stderr
