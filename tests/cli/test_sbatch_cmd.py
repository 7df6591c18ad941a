"""`zerorun sbatch`: the batch script it writes (the real submission runs in
tests/multinode/test_schedulers.py against a real Slurm)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from zerorun.cli.sbatch_cmd import batch_script, parse_args
from zerorun.errors import LaunchError


def test_dry_run_prints_the_script(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = subprocess.run(
        [sys.executable, "-m", "zerorun", "sbatch", "-N", "4", "--gpus_per_node", "8", "-t", "12:00:00", "-p", "gpu",
         "-A", "proj", "--sbatch_args", "--qos high --exclusive", "--script", str(tmp_path / "job.sh"), "--dry-run",
         "--num_gpus", "8", "train.py", "--deepspeed", "my ds.json", "--note=$(rm -rf /)"],
        capture_output=True, text=True, cwd=tmp_path, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text == (tmp_path / "job.sh").read_text()
    assert text.startswith("#!/bin/bash\n")
    for line in ["#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8", "#SBATCH --time=12:00:00",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --qos high --exclusive",
                 "#SBATCH --output=zerorun-%j.out", f"cd {tmp_path}"]:
        assert line + "\n" in text, text
    # The zerorun command verbatim, every argument shell-quoted: nothing of it runs as shell code.
    assert text.endswith(
        f"exec {sys.executable} -m zerorun --num_gpus 8 train.py --deepspeed 'my ds.json' '--note=$(rm -rf /)'\n"
    )


def test_our_options_stop_at_the_command() -> None:
    opts = parse_args(["-N", "2", "--dry-run", "--", "-N", "3", "train.py"])
    assert (opts.nodes, opts.dry_run, opts.command) == (2, True, ["-N", "3", "train.py"])
    opts = parse_args(["--nodes=2", "train.py", "-t", "5"])
    assert opts.command == ["train.py", "-t", "5"] and opts.time is None
    assert "--ntasks-per-node" not in batch_script(opts, python="py", cwd="/")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train.py"], "-N/--nodes"),
        (["-N", "0", "train.py"], "positive whole number"),
        (["-N", "two", "train.py"], "positive whole number"),
        (["-N", "2"], "the zerorun command"),
        (["-N", "2", "--time"], "needs a value"),
        (["-N", "2", "--hostfile", "h", "train.py"], "leave out"),
        (["-N", "2", "--launcher=ssh", "train.py"], "leave out"),
        (["-N", "2", "--node_rank", "1", "train.py"], "leave out"),
    ],
)
def test_errors(argv: list[str], message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        parse_args(argv)


def test_the_scripts_own_arguments_are_not_ours() -> None:
    """A script that takes its own --hostfile or --launcher is fine: only the launch options
    before the script are checked."""
    opts = parse_args(["-N", "2", "--num_gpus", "8", "train.py", "--hostfile", "h", "--launcher=x"])
    assert opts.command == ["--num_gpus", "8", "train.py", "--hostfile", "h", "--launcher=x"]
