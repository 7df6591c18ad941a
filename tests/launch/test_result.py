"""launch/result.py: exit statuses decoded for people and mapped to exit codes."""

from __future__ import annotations

from zerorun.launch.result import describe_exit, exit_code_for


def test_exit_decoding() -> None:
    assert describe_exit(0) == "exit 0" and describe_exit(3) == "exit 3"
    assert describe_exit(-9).startswith("signal 9 (SIGKILL): likely the OOM killer")
    assert "/dev/shm too small" in describe_exit(-7)
    assert describe_exit(-6).startswith("signal 6 (SIGABRT)")
    assert exit_code_for(3) == 3 and exit_code_for(-9) == 137 and exit_code_for(-15) == 143
