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
