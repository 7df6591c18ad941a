"""``deepspeed.initialize`` with the engine's own checkpoint options: ``zerorun.checkpoint
.every_n_steps`` and ``--save_on_preemption`` act at ``DeepSpeedEngine.step``'s boundary as at
``Engine.step``'s (a hook, docs/fault-tolerance.md). Real ranks on gloo through the launcher
with --deepspeed-compat: one uninterrupted run (periodic saves), one preempted by a SIGTERM to
one rank (all ranks save the same step, exit 75), and its resumption (auto_resume), whose
losses and final fp32 masters equal the uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from runtime.checkpoint._ft_job import ft_config, ft_losses

from ._run import PYTHON, ROOT, env

WORKER = ROOT / "tests" / "runtime" / "checkpoint" / "_ft_worker.py"
STEPS = 8


def _launch(out: Path, *args: str, slow: str = "0") -> subprocess.Popen[str]:
    extra = {"FT_COMPAT": "1", "FT_CONFIG": json.dumps(ft_config(out / "ckpt")), "FT_OUT": str(out), "FT_STEPS": str(STEPS)}
    return subprocess.Popen(
        [PYTHON, "-m", "zerorun", "--deepspeed-compat", "--num_gpus", "2", "--device", "cpu", *args, str(WORKER)],
        cwd=ROOT, env=env(FT_SLOW=slow, TORCH_CPP_LOG_LEVEL="ERROR", **extra), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
    try:
        _out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _out, err = proc.communicate()
        raise AssertionError(f"the launcher did not finish in {timeout} s\n{err[-4000:]}") from None
    return proc.returncode, err


def test_periodic_saves_and_preemption_act_through_the_deepspeed_engine(tmp_path: Path) -> None:
    from zerorun.runtime.checkpoint import get_fp32_state_dict

    ref = tmp_path / "ref"
    ref.mkdir()
    code, err = _finish(_launch(ref), 180)
    assert code == 0, err[-4000:]
    ckpt = ref / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == [f"global_step{s}" for s in (2, 4, 6, 8)]
    assert (ckpt / "latest").read_text() == "global_step8"
    assert "not acted on under --deepspeed-compat" not in err
    # The periodic saves carry DeepSpeed's files too, written before each commit (stage 2, fp32).
    assert sorted(p.name for p in (ckpt / "global_step8").glob("*_states.pt")) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert (ckpt / "zero_to_fp32.py").is_file()

    run = tmp_path / "run"
    run.mkdir()
    proc = _launch(run, "--save_on_preemption", slow="0.25")
    deadline = time.monotonic() + 120
    losses = run / "losses_rank0.jsonl"
    while not (losses.exists() and len(losses.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline and proc.poll() is None, "the job did not reach step 2"
        time.sleep(0.1)
    os.kill(int((run / "pid_rank1").read_text()), signal.SIGTERM)  # one rank, as Slurm may
    code, err = _finish(proc, 120)
    assert code == 75, err[-4000:]
    saved = (run / "ckpt" / "latest").read_text()
    step = int(saved.removeprefix("global_step"))
    assert 2 <= step < STEPS and f"preempted; checkpoint {saved} saved" in err, err[-4000:]
    assert not (run / "final").exists()

    code, err = _finish(_launch(run), 180)  # the next submission: auto_resume loads `latest`
    assert code == 0, err[-4000:]
    assert f"resumed from {run / 'ckpt' / saved} at step {step}" in err
    got, want = ft_losses(run), ft_losses(ref)
    assert sorted(got) == [s for s in range(1, STEPS + 1) if s != step]
    assert all(got[s] == want[s] for s in got), (got, want)
    a, b = get_fp32_state_dict(run / "final"), get_fp32_state_dict(ref / "final")
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max().item() <= 1e-6 * b[k].abs().max().item(), k
