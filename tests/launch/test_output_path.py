"""The rank-output path: rank pipes -> the local reader (coalescing, 256 KiB pipes) -> the
consoles. Real rank processes for what the reader must never do (reorder, lose, cut lines);
the rich console's pre-rendered fast path against rich's own rendering of the same lines."""

from __future__ import annotations

import io
import sys
import threading
import time
from pathlib import Path

import pytest
from _plans import plan_for

from zerorun.launch.console import RichConsole
from zerorun.launch.messages import RankExit, RankLines, RankOutput

_RANK = """import os, sys, time
rank = int(os.environ["RANK"])
n = 20_000
# A flood: ~500 KiB in writes of 200 lines (more than Linux's default 64 KiB pipe), stdout and
# stderr interleaved, every line numbered per stream.
for start in range(0, n, 200):
    sys.stdout.write("".join(f"out {rank} {i} " + "x" * 10 + "\\n" for i in range(start, start + 200)))
    print(f"err {rank} {start // 200}", file=sys.stderr)
# A line written in two pieces with a pause between: one line, not two.
sys.stdout.write("partial-"); sys.stdout.flush(); time.sleep(0.05); sys.stdout.write("end\\n")
sys.stdout.flush()
# The last bytes, no newline, then an exit that skips every flush: nothing may be lost.
os.write(1, f"unterminated {rank}".encode())
os._exit(3 if rank else 0)
"""


def test_rank_lines_keep_their_order_and_nothing_is_lost_at_exit(tmp_path: Path) -> None:
    from _launch import base_env

    from zerorun.launch.hosts import Host
    from zerorun.launch.local import LocalRunner
    from zerorun.launch.plan import DeviceInfo, LaunchOptions, Target, build_plan

    script = tmp_path / "flood.py"
    script.write_text(_RANK)
    options = LaunchOptions(target=Target(script=str(script)), device="cpu")
    plan = build_plan(
        options, [Host("localhost", (0, 1))], DeviceInfo(gpus=(), cores=2), master_port=29500,
        run_id="output-path", cwd=str(tmp_path),
    )
    env, _tag = base_env()
    got: list[object] = []
    exited: list[int] = []
    exits = threading.Event()

    def sink(msg: object) -> None:
        got.append(msg)
        if isinstance(msg, RankExit):
            exited.append(msg.rank)
            if len(exited) == 2:
                exits.set()

    runner = LocalRunner(plan, plan.nodes[0], python=sys.executable, environ=env)
    runner.start(sink)
    import fcntl

    from zerorun.launch import local

    sizes = {s.kind: fcntl.fcntl(s.fd, fcntl.F_GETPIPE_SZ) for s in runner._ranks[0].streams}
    assert sizes["stdout"] == sizes["stderr"] == local._PIPE_SIZE and sizes["events"] == 1 << 16
    try:
        assert exits.wait(60), "ranks did not exit"
    finally:
        runner.kill()
        runner.close()
    for rank in (0, 1):
        mine = [m for m in got if getattr(m, "rank", None) == rank]
        assert isinstance(mine[-1], RankExit) and mine[-1].returncode == (3 if rank else 0)
        out = [t for m in mine if isinstance(m, RankLines) and m.stream == "stdout" for t in m.lines]
        err = [t for m in mine if isinstance(m, RankLines) and m.stream == "stderr" for t in m.lines]
        assert out[:20_000] == [f"out {rank} {i} " + "x" * 10 for i in range(20_000)]
        assert out[20_000:] == ["partial-end", f"unterminated {rank}"]
        assert err == [f"err {rank} {i}" for i in range(100)]
        # One message per read of a pipe, not per line: 20,202 lines in at most a few hundred.
        assert not any(isinstance(m, RankOutput) for m in mine)
        assert len([m for m in mine if isinstance(m, RankLines)]) < 1000


def _rich(plan, states, **kw) -> tuple[RichConsole, io.StringIO]:  # type: ignore[no-untyped-def]
    from rich.console import Console

    out = io.StringIO()
    console = RichConsole(**kw)
    # Not interactive: no live panel in the captured text, only the lines.
    console.console = Console(file=out, force_terminal=True, force_interactive=False, width=100, highlight=False)
    console.begin(plan, states)
    out.seek(0)
    out.truncate()
    return console, out


def test_rich_console_prints_what_rich_text_would() -> None:
    """The pre-rendered path prints the same characters and colours as building a rich Text
    per line did (the old path: ~50 us of launcher CPU a line), markup and escapes as they are."""
    from rich.console import Console
    from rich.text import Text

    from zerorun.launch.result import RankState

    plan = plan_for(num_gpus=2)
    states = [RankState(spec) for spec in plan.ranks]
    console, out = _rich(plan, states)
    lines = [
        RankOutput(0, "stdout", "step 1 [bold]not markup[/bold] \x07bell"),
        RankOutput(1, "stderr", "warning \x1b[31mred from the rank\x1b[0m"),
        RankOutput(1, "stdout", "after"),
        RankOutput(0, "stdout", "step 2"),
    ]
    console.output(lines)
    console.stop()
    ref = io.StringIO()
    old = Console(file=ref, force_terminal=True, force_interactive=False, width=100, highlight=False)
    for line in lines:
        style = ("cyan", "magenta")[line.rank]
        text = Text()
        text.append(f"[{line.rank}]", style=style)
        text.append(" " if line.stream == "stdout" else "! ", style=style)
        text.append(line.text, style="dim" if line.stream == "stderr" else "")
        old.print(text, soft_wrap=True)

    def plain(s: str) -> str:
        import re

        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", s)

    assert plain(out.getvalue()) == plain(ref.getvalue())
    assert plain(out.getvalue()).splitlines() == [
        "[0] step 1 [bold]not markup[/bold] bell",
        "[1]! warning red from the rank",
        "[1] after",
        "[0] step 2",
    ]
    # Colours: each rank's prefix in its colour, stderr dimmed, the rank's own escapes kept.
    assert out.getvalue().splitlines()[0].startswith("\x1b[36m[0]")
    assert "\x1b[2mwarning \x1b[31mred" in out.getvalue()


def test_rich_console_prints_lines_in_timed_batches_and_keeps_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines wait for the next refresh at most `_PRINT_EVERY_S` after the last print (each print
    redraws the live panel); a note or stop prints them first. Small batches -- what the
    supervisor hands over while ranks print fast -- cost little per line."""
    from zerorun.launch import console as console_mod
    from zerorun.launch.result import RankState

    plan = plan_for(num_gpus=2)
    states = [RankState(spec) for spec in plan.ranks]
    console, out = _rich(plan, states, ranks=frozenset({1}))
    monkeypatch.setattr(console_mod, "_PRINT_EVERY_S", 60.0)
    console._printed_at -= 61  # a quiet spell: the next line goes at the next refresh
    console.output([RankOutput(0, "stdout", "hidden"), RankOutput(1, "stdout", "shown")])
    console.refresh()
    assert "hidden" not in out.getvalue() and "shown" in out.getvalue()
    console.output([RankOutput(1, "stdout", "soon")])
    console.refresh()
    assert "soon" not in out.getvalue()  # printed less than _PRINT_EVERY_S ago: waits
    console._printed_at -= 61
    console.refresh()
    assert "soon" in out.getvalue()
    console.output([RankOutput(1, "stderr", "before the note")])
    console.note("a note")
    text = out.getvalue()
    assert text.index("before the note") < text.index("a note")
    monkeypatch.setattr(console_mod, "_PRINT_EVERY_S", 0.025)
    batch = [RankOutput(1, "stdout", f"line {i}") for i in range(20)]
    t0 = time.process_time()
    for _ in range(2000):
        console.output(batch)
        console.refresh()
    per_line = (time.process_time() - t0) / 40_000
    console.output([RankOutput(1, "stdout", "the last")])
    console.stop()
    assert out.getvalue().count("line 19") == 2000 and "the last" in out.getvalue()
    # ~2 us here; printing each batch of 20 (a panel redraw each) cost ~70 us a line, and the
    # per-line rich Text before that ~50 us more. A wide margin for a loaded CI machine.
    assert per_line < 20e-6, f"{per_line * 1e6:.1f} us per line"
