"""A rank program for the restart tests (tests/launch/test_restart.py), no torch: RJ_MODE picks
the failure. setup_error: every rank raises the same exception at once (a config mistake);
kill: rank 1 SIGKILLs itself (every attempt), the others wait to be stopped; vanish: the same,
after deleting this script; preempt: on
SIGTERM a rank does what the engine does with --save_on_preemption (a `preempted` event, exit 75)."""

from __future__ import annotations

import os
import signal
import sys
import time

MODE = os.environ.get("RJ_MODE", "setup_error")
RANK = int(os.environ.get("RANK", "0"))

if MODE == "setup_error":
    raise ValueError("learning rate 'fast' is not a number")
if MODE == "kill":
    if RANK == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
if MODE == "vanish":
    # Rank 1 takes the script away (a file system gone from the node, say) and dies: the next
    # attempt cannot start.
    if RANK == 1:
        time.sleep(0.3)
        os.remove(os.path.abspath(sys.argv[0]))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
if MODE == "preempt":
    from zerorun.channel import events

    def on_term(_signum: int, _frame: object) -> None:
        events.emit("preempted", tag="global_step3", dir="/ckpt", step=3)
        sys.exit(75)

    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    time.sleep(60)
sys.exit(f"unknown RJ_MODE {MODE}")
