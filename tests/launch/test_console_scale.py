"""The console of a job with thousands of ranks (launch/console.py's large-job view, launch/rollup.py)."""

from __future__ import annotations

import io
import time

from zerorun.launch import rollup
from zerorun.launch.console import PlainConsole, RichConsole
from zerorun.launch.messages import RankOutput
from zerorun.launch.result import JobResult, RankState
from zerorun.launch.simulate import sim_plan

WARN = "UserWarning: torch.cuda.amp.GradScaler is deprecated"


def test_rank_sets_are_ranges_and_long_ones_are_cut():
    assert rollup.rank_set(range(8000)) == "[0-7999]"
    assert rollup.rank_set([9, 0, 1, 2, 3, 5, 8]) == "[0-3,5,8-9]"
    assert rollup.rank_set([4]) == "[4]"
    cut = rollup.rank_set(range(0, 8000, 2))
    assert cut.endswith(",...,7998] (4000 ranks)") and len(cut) < 80
    assert rollup.is_notable(WARN) and rollup.is_notable("RuntimeError: CUDA out of memory")
    assert rollup.is_notable("loss is nan at step 3")
    assert not rollup.is_notable("step 10 loss 3.2 errors=0") and not rollup.is_notable("warnings_total 0")


def test_dedup_shows_each_text_once_with_its_ranks():
    d = rollup.Dedup(window_s=1.0)
    for r in range(8000):
        d.add(r, WARN, now=10.0 + r * 1e-5)
    d.add(3, "Error: other", now=10.5)
    assert d.due(10.9) == []  # the window is still open
    assert d.due(11.2) == ["[0-7999] " + WARN]
    assert d.due(11.7) == ["[3] Error: other"]
    for r in range(8000):  # every rank again: already shown, only counted
        d.add(r, WARN, now=20.0)
    assert d.due(30.0) == [] and d.repeats == 8000
    d.add(8000, WARN, now=31.0)
    d.add(8000, WARN, now=31.1)
    assert d.due(0.0, flush=True) == ["[8000] " + WARN + " (x2)"]


def _large_job(nodes: int = 1000, per: int = 8):
    plan = sim_plan(nodes, per)
    states = [RankState(spec) for spec in plan.ranks]
    for s in states:
        s.state, s.pid = "running", 1000 + s.rank
        s.status = {"step": 100 - (s.rank == 4242) * 7}
        s.gpu = {"allocated": (10 + s.rank % 3) << 30}
        s.rss = (200 + s.rank % 5) << 20
    return plan, states


def test_plain_console_of_8000_ranks_prints_rank_0_and_deduplicated_warnings():
    plan, states = _large_job()
    out, err = io.StringIO(), io.StringIO()
    console = PlainConsole(out=out, err=err)
    console.status_interval_s = 0.0
    t0 = time.monotonic()
    console.begin(plan, states)
    for step in range(3):
        console.output([RankOutput(r, "stdout", f"step {step} loss 3.2") for r in range(8000)])
        console.output([RankOutput(r, "stderr", WARN) for r in range(8000)])
    console.output([RankOutput(4242, "stderr", "RuntimeError: boom")])
    console.refresh()  # the status line
    elapsed = time.monotonic() - t0
    assert out.getvalue().splitlines() == [f"[sim-0000:0]    step {i} loss 3.2" for i in range(3)]
    text = err.getvalue()
    assert "8000 ranks on 1000 node(s): showing the lines of rank(s) [0]" in text
    assert "8000 ranks: 8000 running | step 93-100 (slowest node sim-0530) | GPU 10.0 GiB-12.0 GiB" in text
    assert WARN not in text.replace(f"[sim-0000:0]    {WARN}", "")  # only rank 0's, until the window closes
    states[4242].state, states[4242].returncode = "failed", 1
    for s in states:
        if s.rank != 4242:
            s.state, s.returncode = "stopped", -15
    console.end(JobResult(exit_code=1, reason="rank_failed", ranks=states, wall_s=1.0, first_failure=4242, message="m"))
    text = err.getvalue()
    assert text.count(WARN) == 4  # rank 0's three, then one line for everyone
    assert f"[0-7999] {WARN} (x24000)" in text
    assert "[4242] RuntimeError: boom" in text
    assert "8000 ranks: 7999 signal 15 (SIGTERM) (stopped), 1 exit 1" in text
    assert "... and 7980 more (summary.json has them all)" in text
    assert len(text.splitlines()) < 60 and elapsed < 5.0


def test_rich_console_of_8000_ranks_shows_one_row_per_node_slowest_first():
    plan, states = _large_job()
    from rich.console import Console

    buf = io.StringIO()
    console = RichConsole()
    console.console = Console(file=buf, force_terminal=True, width=200, height=30)
    console.begin(plan, states)
    console.output([RankOutput(r, "stdout", f"line of {r}") for r in (0, 4242, 4243)])
    console.refresh()
    console.stop()
    text = buf.getvalue()
    assert "line of 0" in text and "line of 4242" not in text.split("node")[0]
    panel = text[text.rindex("running/ok/failed"):]  # the last rendering
    first_row = panel.splitlines()[1]
    assert "sim-0530" in first_row and "93-100" in first_row and "line of 4243" in first_row
    assert "978 more node(s)" in panel and "sim-0999" not in panel
