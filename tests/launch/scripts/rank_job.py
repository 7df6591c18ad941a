"""A rank program for the launcher tests; what it does is chosen by ZR_MODE (deterministic:
no timers race the launcher). Stdlib only unless the mode needs collectives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

MODE = os.environ.get("ZR_MODE", "hello")
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def collectives() -> None:
    """torchrun style: the script creates the process group itself."""
    import datetime

    import torch
    import torch.distributed as dist

    from zerorun.channel import events

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    t = torch.full((4,), float(RANK + 1))
    dist.all_reduce(t)
    expected = WORLD * (WORLD + 1) / 2
    assert t.tolist() == [expected] * 4, t
    gathered = [torch.zeros(2) for _ in range(WORLD)]
    dist.all_gather(gathered, torch.full((2,), float(RANK)))
    assert [g[0].item() for g in gathered] == list(range(WORLD))
    events.set_memory_provider(lambda: {"params": 1000 * (RANK + 1), "cpu": {"optimizer_states": 8000}})
    events.emit("status", step=7, loss=0.5 + RANK)
    print(f"allreduce ok {t[0].item():g} rank={RANK} local={os.environ['LOCAL_RANK']} "
          f"omp={os.environ.get('OMP_NUM_THREADS')} run={os.environ['ZERORUN_RUN_ID']}")
    print(f"stderr line from {RANK}", file=sys.stderr)
    dist.barrier()
    dist.destroy_process_group()


def fail_fast() -> None:
    """Both ranks meet in a collective, then rank 1 exits 3 and rank 0 waits in the next one."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"rank {RANK} passed the first all_reduce ({t.item():g})", flush=True)
    if RANK == 1:
        print("rank 1 is failing on purpose", file=sys.stderr, flush=True)
        sys.exit(3)
    # Rank 0 ignores the peer error and sits here, so the launcher must stop it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        dist.all_reduce(t)
    except Exception:  # noqa: BLE001 - the peer is gone; wait to be terminated
        pass
    time.sleep(120)


def spawn_children() -> None:
    """A child in the rank's group and one that escapes it with setsid, then wait."""
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    time.sleep(0.3)
    print(f"ready {RANK}", flush=True)
    time.sleep(300)


def main() -> None:
    if MODE == "hello":
        print(f"hello {RANK}/{WORLD} argv={sys.argv[1:]} name={__name__}")
    elif MODE == "orphan":
        # Rank 1 leaves a detached child behind and exits 0; rank 0 watches that child die
        # (the rank's sentinel removes it) while the job is still running.
        pid_file = os.environ["ZR_PID_FILE"]
        if RANK == 1:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
            with open(pid_file + ".tmp", "w") as fh:
                fh.write(str(child.pid))
            os.rename(pid_file + ".tmp", pid_file)
            return
        deadline = time.monotonic() + 20
        while not os.path.exists(pid_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int(open(pid_file).read())
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                        break
            except OSError:
                break
            time.sleep(0.05)
        else:
            raise SystemExit("the orphan of rank 1 is still alive")
        print("orphan gone", flush=True)
    elif MODE == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(f"ready {RANK}", flush=True)
        time.sleep(120)
    elif MODE == "many":
        for i in range(20000):
            print(f"line {i} of rank {RANK}")
    elif MODE == "collectives":
        collectives()
    elif MODE == "fail_fast":
        fail_fast()
    elif MODE == "sigkill":
        print(f"rank {RANK} up", flush=True)
        if RANK == int(os.environ.get("ZR_RANK", "1")):
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
    elif MODE == "children":
        spawn_children()
    elif MODE == "hang":
        from zerorun.channel import events

        events.emit("status", step=5 if RANK == 0 else 3)
        print(f"rank {RANK} about to hang", flush=True)
        if RANK == 1:
            slow_rank_stuck_here()
        stuck_in_a_function_named_wait_forever()
    elif MODE == "raise":
        if RANK == 0:
            raise ValueError("broken on purpose")
        time.sleep(120)
    else:
        raise SystemExit(f"unknown ZR_MODE {MODE}")


def stuck_in_a_function_named_wait_forever() -> None:
    while True:
        time.sleep(0.5)


def slow_rank_stuck_here() -> None:
    while True:
        time.sleep(0.5)


if __name__ == "__main__":
    main()
