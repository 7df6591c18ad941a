"""The cheapest rank: no torch. Prints where it runs and its argv, then:
- the rank named by MN_FAIL_RANK waits for the file MN_READY (written by the others once they
  run: a deterministic order, no timers), then exits MN_FAIL_CODE (default 3);
- with MN_HANG set, the other ranks sleep in `stuck_here` (stopped by the launcher, or asked
  for their stacks);
- otherwise exits 0.
"""

import os
import socket
import sys
import time

rank = os.environ["RANK"]
print(f"HELLO rank={rank} node_rank={os.environ['NODE_RANK']} host={socket.gethostname()} argv={sys.argv[1:]!r}", flush=True)


def stuck_here() -> None:  # the frame a stack dump must show
    time.sleep(600)


if os.environ.get("MN_FAIL_RANK") == rank:
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ["MN_READY"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    print("failing on purpose", file=sys.stderr, flush=True)
    sys.exit(int(os.environ.get("MN_FAIL_CODE", "3")))
if os.environ.get("MN_READY"):
    with open(os.environ["MN_READY"], "w") as fh:
        fh.write(rank)
if os.environ.get("MN_HANG"):
    stuck_here()
