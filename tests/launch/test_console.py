"""launch/console.py: the plain and the rich console render output and the job's end."""

from __future__ import annotations

import io

from _plans import plan_for

from zerorun.launch.console import PlainConsole, RichConsole
from zerorun.launch.console_format import flatten_breakdown, format_bytes
from zerorun.launch.hosts import Host
from zerorun.launch.messages import RankOutput
from zerorun.launch.result import JobResult, RankState


def test_console_rendering() -> None:
    assert format_bytes(None) == "-" and format_bytes(512) == "512 B" and format_bytes(3 * 2**30) == "3.0 GiB"
    assert flatten_breakdown({"params": 4, "cuda:0": {"grads": 2, "x": "no"}, "flag": True}) == {
        "params": 4, "cuda:0.grads": 2,
    }
    plan = plan_for(num_gpus=2)
    out, err = io.StringIO(), io.StringIO()
    console = PlainConsole(ranks=frozenset({1}), out=out, err=err)
    states = [RankState(spec) for spec in plan.ranks]
    console.begin(plan, states)
    console.output([RankOutput(0, "stdout", "hidden"), RankOutput(1, "stdout", "a"), RankOutput(1, "stderr", "b")])
    assert out.getvalue() == "[1] a\n" and "[1] b\n" in err.getvalue()
    states[0].returncode, states[0].state, states[0].breakdown = 0, "exited", {"params": 2048}
    states[1].returncode, states[1].state, states[1].error = -9, "failed", {"type": "E", "message": "m"}
    states[1].stderr_tail.append("last words")
    result = JobResult(exit_code=137, reason="rank_failed", ranks=states, wall_s=1.0, first_failure=1, message="boom")
    console.end(result)
    text = err.getvalue()
    assert "FAILED" in text and "signal 9 (SIGKILL)" in text and "last words" in text and "exception: E: m" in text
    assert "2.0 KiB" in text and "\x1b[" not in text
    rich_out = io.StringIO()
    rich = RichConsole()
    from rich.console import Console

    rich.console = Console(file=rich_out, force_terminal=True, width=120)
    rich.begin(plan, states)
    rich.output([RankOutput(0, "stdout", "[bold]not markup[/bold]")])
    rich.refresh()
    rich.end(result)
    assert "[bold]not markup[/bold]" in rich_out.getvalue() and "job failed" in rich_out.getvalue()
    # multi-node prefixes look like markup tags; the live panel must print them as they are
    two = plan_for([Host("node1", (0,)), Host("node2", (0,))])
    rich_out.truncate(0)
    rich.begin(two, [RankState(spec) for spec in two.ranks])
    rich.refresh()
    rich.stop()
    assert "[node2:1]" in rich_out.getvalue()


def test_rich_console_prints_lines_that_arrive_after_stop() -> None:
    # A start failure stops the display, then drains the runners: their last lines still print.
    from rich.console import Console

    plan = plan_for(num_gpus=1)
    out = io.StringIO()
    rich = RichConsole()
    rich.console = Console(file=out, force_terminal=True, width=120)
    rich.begin(plan, [RankState(spec) for spec in plan.ranks])
    rich.stop()
    rich.output([RankOutput(0, "stdout", "drained after stop")])
    assert "drained after stop" in out.getvalue()


def test_live_panel_step_cell_shows_each_ranks_timers() -> None:
    from zerorun.launch.console_format import step_cell

    plan = plan_for(num_gpus=2)
    fast, slow = (RankState(spec) for spec in plan.ranks)
    fast.status = {"step": 10, "loss": 2.5, "tokens_per_sec": 12345.0, "samples_per_sec": 6.0,
                   "timers_ms": {"fwd": 10.2, "bwd": 20.0, "step": 5.0}}
    slow.status = {"step": 10, "loss": 2.5, "samples_per_sec": 3.0, "timers_ms": {"fwd": 95.0, "bwd": 20.0, "step": 5.0}}
    assert step_cell(fast) == "step 10 loss 2.5 12.3k tok/s fwd/bwd/step 10/20/5 ms"
    assert "3.0 samples/s fwd/bwd/step 95/20/5 ms" in step_cell(slow)
    slow.status = {"step": 3}
    assert step_cell(slow) == "step 3"
