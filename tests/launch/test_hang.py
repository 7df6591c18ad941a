"""launch/hang.py: the innermost user frame of a stack dump and the rank(s) behind."""

from __future__ import annotations

from _plans import plan_for

from zerorun.launch.hang import hang_report, innermost_user_frame
from zerorun.launch.hosts import local_hosts
from zerorun.launch.result import RankState


def test_hang_analysis() -> None:
    dump = [
        "Thread 0x00007f (most recent call first):",
        '  File "/usr/lib/python3.11/threading.py", line 331 in wait',
        "",
        "Current thread 0x00007e (most recent call first):",
        '  File "/x/train.py", line 40 in all_reduce_step',
        '  File "/x/train.py", line 80 in main',
        '  File "/x/zerorun/shim.py", line 72 in main',
    ]
    assert innermost_user_frame(dump) == "train.py:40 in all_reduce_step"
    assert innermost_user_frame([]) is None
    plan = plan_for(local_hosts(3))
    states = [RankState(spec) for spec in plan.ranks]
    for s, where in zip(states, ("a", "a", "b"), strict=True):
        s.stack_dump = ["Current thread 0x1 (most recent call first):", f'  File "/x/{where}.py", line 1 in f']
    report = hang_report(states)
    assert report[-1] == "behind: rank(s) 2"
    assert "no majority" in hang_report(states[1:])[-1]
    states[0].status, states[1].status, states[2].status = {"step": 9}, {"step": 8}, {"step": 9}
    assert hang_report(states)[-1] == "behind: rank(s) 1"
