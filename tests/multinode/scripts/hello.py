"""The cheapest rank: no torch. Prints where it runs and its argv, exits with MN_EXIT (default 0)."""

import os
import socket
import sys

print(f"HELLO rank={os.environ['RANK']} node_rank={os.environ['NODE_RANK']} host={socket.gethostname()} argv={sys.argv[1:]!r}", flush=True)
sys.exit(int(os.environ.get("MN_EXIT", "0")))
