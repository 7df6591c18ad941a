"""The cheapest rank: no torch. Prints where it runs and its argv, then exits with MN_EXIT
(default 0), or hangs in `stuck_here` when MN_HANG is set."""

import os
import socket
import sys

print(f"HELLO rank={os.environ['RANK']} node_rank={os.environ['NODE_RANK']} host={socket.gethostname()} argv={sys.argv[1:]!r}", flush=True)
if os.environ.get("MN_HANG"):
    import time

    def stuck_here() -> None:  # the frame a stack dump must show
        time.sleep(600)

    stuck_here()
sys.exit(int(os.environ.get("MN_EXIT", "0")))
