"""zerorun/shim.py: a rank's entry point runs a script like python would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_shim_runs_a_script_like_python(tmp_path: Path) -> None:
    """Without a launcher: __name__, argv, sys.path[0], exit codes, clean tracebacks."""
    script = tmp_path / "s.py"
    script.write_text(
        "import os, sys\n"
        "print(__name__, sys.argv, sys.path[0] == os.path.dirname(os.path.abspath(__file__)))\n"
        "if sys.argv[1] == 'exit': sys.exit(5)\n"
        "if sys.argv[1] == 'raise': raise KeyError('k')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("ZERORUN_EVENT_FD", None)

    def shim(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "zerorun.shim", *args], env=env, capture_output=True, text=True, timeout=60, cwd="/")

    res = shim(str(script), "exit")
    assert res.returncode == 5 and res.stdout == f"__main__ ['{script}', 'exit'] True\n"
    res = shim(str(script), "raise")
    assert res.returncode == 1 and res.stderr.startswith("Traceback") and res.stderr.rstrip().endswith("KeyError: 'k'")
    assert "zerorun/shim.py" not in res.stderr and "runpy" not in res.stderr
    res = shim()
    assert res.returncode == 2 and "usage" in res.stderr


def test_shim_under_another_launcher_exports_torchrun_variables(tmp_path: Path) -> None:
    """Started by MPICH's mpiexec (PMI_* only): the script sees torchrun's variables; on several
    hosts without a way to find rank 0's host, a one-line error and exit 1 before the script runs."""
    script = tmp_path / "s.py"
    script.write_text("import os\nprint([os.environ.get(k) for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR')])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "ZERORUN_"))}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[1]), PMI_RANK="1", PMI_SIZE="2", MPI_LOCALRANKID="1",
               MPI_LOCALNRANKS="2")  # fmt: skip

    def shim(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "zerorun.shim", str(script)], env={**env, **extra},
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    res = shim()
    assert res.returncode == 0 and res.stdout == "['1', '2', '1', '127.0.0.1']\n", res.stderr
    res = shim(PMI_SIZE="4")  # 2 of 4 ranks on this host: several hosts, no MASTER_ADDR, no PMIx
    assert res.returncode == 1 and res.stdout == "", res.stdout
    assert res.stderr.startswith("zerorun: ranks run on several hosts but MASTER_ADDR is not set: export MASTER_ADDR")
    assert "Traceback" not in res.stderr
    assert shim(PMI_SIZE="4", MASTER_ADDR="10.0.0.7").stdout == "['1', '4', '1', '10.0.0.7']\n"
