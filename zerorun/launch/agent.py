"""The node agent: `python -m zerorun.launch.agent`, started by the launcher over SSH.

It speaks `launch/wire.py` on its stdin/stdout (the SSH channel) and starts its node's ranks
with `launch.local.LocalRunner`, the very code that runs one-node jobs: same shim, same
process groups, same environment layering, same kill sweep. It only adds the channel.

Life and death (the point of having an agent rather than a bare remote command: closing an
SSH channel without a pty leaves the remote command running):
- stdin EOF (the launcher died or closed the connection) -> SIGKILL every rank, exit;
- no message from the launcher for `heartbeat_timeout_s` (a dropped link closes nothing)
  -> SIGKILL every rank, exit; a rank blocked in a collective would otherwise wait out
  its process-group timeout;
- SIGTERM / SIGHUP / SIGINT to the agent (acted on by a thread: `install_signal_handlers`) -> the
  same; except SIGTERM with `--save_on_preemption`
  (`plan.preemption_grace` set): it goes to each rank alone, which saves a checkpoint and exits
  75 (reported as usual), and only ranks still alive after the grace period are killed;
- its stdout (the channel) breaks -> the same.
Ranks carry the agent's pid as their launcher (`ZERORUN_LAUNCHER_PID`), so the shim's
parent-death signal ties them to the agent even if it is SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from zerorun.launch import wire
from zerorun.launch.messages import RankLines, RankOutput

__all__ = ["main", "hello", "port_in_use", "LineBatcher"]

# Before the plan arrives the launcher is still running its preflight on the other nodes.
_PRE_PLAN_TIMEOUT_S = 120.0


class _Channel:
    """The protocol side of fd 1, written whole lines at a time from several threads."""

    def __init__(self, fd: int, on_broken: Any) -> None:
        self.fd = fd
        self.lock = threading.Lock()
        self.on_broken = on_broken

    def send(self, kind: str, **fields: Any) -> None:
        self.write(wire.encode(kind, **fields))

    def write(self, encoded: bytes) -> None:
        """Encoded messages (whole lines), in one piece."""
        data = memoryview(encoded)
        with self.lock:
            try:
                while data:
                    n = os.write(self.fd, data)
                    data = data[n:]
            except OSError:
                self.on_broken("the channel to the launcher broke")


# A batch of rank lines goes out at this many lines or bytes at the latest.
_BATCH_LINES = 1000
_BATCH_BYTES = 1 << 18


class LineBatcher:
    """The agent's sink: rank lines travel in `lines` messages, each carrying runs of
    consecutive lines of one rank's stream (many ranks' lines in one JSON object), and a batch
    is one write() (a JSON object and a write per line cost the launcher 11-38 us of CPU a
    line). Lines wait only until the runner ends its turn of reading (`flush()`: LocalRunner
    after each turn of its reader, the synthetic runner after each tick), a batch is full, or
    another message comes: a started/event/exit message sends the lines before it and then
    itself at once, so the order is kept and exits are not delayed. The agent's watchdog
    flushes at every heartbeat too."""

    def __init__(self, channel: _Channel) -> None:
        self.channel = channel
        self._lock = threading.Lock()
        self._out: list[bytes] = []  # encoded messages waiting to be written
        self._runs: list[tuple[int, str, list[str]]] = []  # the open `lines` message
        self._lines = 0
        self._bytes = 0

    def __call__(self, m: Any) -> None:
        if isinstance(m, (RankLines, RankOutput)):
            lines = m.lines  # a RankOutput is a run of one line
            with self._lock:
                runs = self._runs
                if runs and runs[-1][0] == m.rank and runs[-1][1] == m.stream:
                    runs[-1][2].extend(lines)
                else:
                    runs.append((m.rank, m.stream, list(lines)))
                self._lines += len(lines)
                self._bytes += sum(map(len, lines))
                if self._lines >= _BATCH_LINES or self._bytes >= _BATCH_BYTES:
                    self._send()
            return
        encoded = wire.message_to_wire(m)
        if encoded is None:
            return
        with self._lock:
            self._close_lines()
            self._out.append(wire.encode(encoded[0], **encoded[1]))
            self._send()

    def flush(self) -> None:
        with self._lock:
            self._send()

    def _close_lines(self) -> None:
        if self._runs:
            self._out.append(wire.encode("lines", runs=self._runs))
            self._runs = []

    def _send(self) -> None:
        self._close_lines()
        if self._out:
            data, self._out = b"".join(self._out), []
            self._lines = self._bytes = 0
            self.channel.write(data)


def _say(text: str) -> None:
    """A line on the agent's stderr, which may be gone: over SSH it is the connection's stderr,
    closed with it (EPIPE), exactly when the agent has to kill its ranks and exit."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


class Agent:
    """One node's agent. `exit` ends it (the process, normally; the scale simulation hosts many
    agents in one process and closes the agent's channel instead); `runner_factory(plan, node)`
    builds the node's runner (default: `LocalRunner`, real rank processes)."""

    def __init__(
        self,
        channel_fd: int,
        *,
        exit: Callable[[int], None] = os._exit,  # noqa: A002 - what it does
        runner_factory: Callable[[Any, Any], Any] | None = None,
    ) -> None:
        self.channel = _Channel(channel_fd, self.die)
        self.runner: Any = None
        self.plan: Any = None
        self.last_heard = time.monotonic()
        self.heartbeat_s = 1.0
        self.heartbeat_timeout_s = _PRE_PLAN_TIMEOUT_S
        self.dead = False
        self._exit = exit
        self._runner_factory = runner_factory
        self._dying = threading.Lock()
        self._preempting = False
        self._batcher: LineBatcher | None = None

    # -- death ------------------------------------------------------------------------------

    def die(self, why: str, code: int = 0) -> None:
        """Kill every rank and exit the process now (from any thread)."""
        if not self._dying.acquire(blocking=False):
            return
        try:
            if self.runner is not None:
                try:
                    self.runner.kill()
                except Exception as err:  # noqa: BLE001 - exiting anyway
                    _say(f"zerorun agent: kill failed: {err}")
            _say(f"zerorun agent on {socket.gethostname()}: {why}")
        finally:
            # Whatever happened above: a die() that returned would leave the agent running with
            # `_dying` held, and every later die() (EOF, heartbeat) a no-op.
            self.dead = True
            self._exit(code)

    def preempt(self) -> None:
        """SIGTERM with --save_on_preemption: the ranks save and exit by themselves (their exits
        reach the launcher as usual); whatever is left after the grace period is killed."""
        grace = getattr(self.plan, "preemption_grace", None)
        if self.runner is None or grace is None:
            self.die("got SIGTERM; killed this node's ranks")
            return
        if self._preempting:
            return  # the ranks have their SIGTERM and the grace is running
        self._preempting = True
        _say(f"zerorun agent on {socket.gethostname()}: got SIGTERM; the ranks save and exit ({grace:g} s)")
        self.runner.signal(signal.SIGTERM, tree=False)
        timer = threading.Timer(grace, self.die, args=(f"the ranks did not exit within {grace:g} s of SIGTERM; killed them",))
        timer.daemon = True
        timer.start()

    def watchdog(self) -> None:
        while True:
            time.sleep(min(self.heartbeat_s, 1.0))
            self.tick(time.monotonic())

    def tick(self, now: float) -> None:
        """Once per heartbeat: die when the launcher went silent, else say we are alive."""
        silent = now - self.last_heard
        if silent > self.heartbeat_timeout_s:
            self.die(f"no heartbeat from the launcher for {silent:.1f} s; killed this node's ranks", 3)
        elif self.runner is not None:
            if self._batcher is not None:
                self._batcher.flush()  # a runner that never ends a turn still gets its lines out
            self.channel.send("hb")

    # -- messages ---------------------------------------------------------------------------

    def handle(self, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == "preflight":
            self.channel.send("hello", **hello(msg))
        elif kind == "plan":
            self.start(msg)
        elif kind == "signal" and self.runner is not None:
            self.runner.signal(int(msg["sig"]), tree=bool(msg.get("tree", True)))
        elif kind == "kill" and self.runner is not None:
            self.runner.kill()

    def start(self, msg: dict[str, Any]) -> None:
        from zerorun.errors import ZerorunError
        from zerorun.launch.local import LocalRunner
        from zerorun.launch.plan import default_omp_threads

        self.heartbeat_s = float(msg.get("heartbeat_s", 1.0))
        self.heartbeat_timeout_s = float(msg.get("heartbeat_timeout_s", 10.0))
        plan = wire.plan_from_dict(msg["plan"])
        node = plan.nodes[int(msg["node_rank"])]
        if "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in node.env:
            # Only this node knows its cores; the launcher could not fill this in.
            threads = default_omp_threads(os.cpu_count() or 1, len(node.ranks))
            plan = replace(plan, omp_threads={**plan.omp_threads, node.node_rank: threads})

        sink = self._batcher = LineBatcher(self.channel)
        if self._runner_factory is not None:
            runner = self._runner_factory(plan, node)
        else:
            runner = LocalRunner(plan, node, python=sys.executable, environ=os.environ)
        self.runner = runner
        self.plan = plan
        try:
            runner.start(sink)
        except ZerorunError as err:
            self.channel.send("error", message=str(err))
            self.die(f"could not start the ranks: {err}", 1)

    def serve(self, stdin: Any) -> None:
        threading.Thread(target=self.watchdog, name="zerorun-agent-watchdog", daemon=True).start()
        while True:
            line = stdin.readline()
            if not line:
                self.die("the launcher closed the connection; killed this node's ranks")
                time.sleep(0.1)  # die() returned: another thread is ending the process; do not spin on EOF
                continue
            self.last_heard = time.monotonic()
            msg = wire.decode(line)
            if msg is not None:
                self.handle(msg)


def hello(msg: dict[str, Any]) -> dict[str, Any]:
    """The preflight answer: who and where we are, and whether the master port is usable."""
    from zerorun._version import __version__

    conn = os.environ.get("SSH_CONNECTION", "").split()
    if _DIALED is not None:  # `--dial`: the TCP connection to the launcher says the same
        conn = [_DIALED[0], "0", _DIALED[1], "0"]
    info: dict[str, Any] = {
        "version": __version__,
        "protocol": wire.PROTOCOL_VERSION,
        "python": sys.executable,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "client_addr": conn[0] if len(conn) == 4 else None,
        "server_addr": conn[2] if len(conn) == 4 else None,
        "port": None,
        "error": None,
        "gpus": _gpu_count(),
    }
    script = msg.get("script")
    runnable = script and (os.path.isfile(script) or os.path.isfile(os.path.join(script, "__main__.py")))
    if script and not runnable:  # `python DIR` runs DIR/__main__.py, as the launcher's own check allows
        info["error_kind"] = "script"
        info["error"] = (
            f"the script {script} does not exist there (working directory {os.getcwd()}). Every "
            "node needs the code at the same path: a shared file system, or copy it first."
        )
        return info
    port = msg.get("check_port")
    if msg.get("pick_port"):
        info["port"] = _free_port()
    elif port is not None:
        if port_in_use(int(port)):
            info["error_kind"] = "port"
            info["error"] = (
                f"master port {port} is already in use there (another job?). Pick another with "
                "--master_port, or leave it out to have a free one chosen."
            )
        info["port"] = int(port)
    return info


def _gpu_count() -> int:
    """NVIDIA GPUs of this node, from their device files (no CUDA, no torch: the preflight
    stays fast)."""
    try:
        names = os.listdir("/dev")
    except OSError:
        return 0
    return sum(1 for n in names if n.startswith("nvidia") and n[6:].isdigit())


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR, as the rendezvous store sets it: a port in TIME_WAIT is usable,
        # one with a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _become_subreaper() -> None:
    # Orphaned grandchildren of ranks come back to the agent, so LocalRunner reaps them.
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


# In `--dial` mode: (the launcher's address, this node's address) of the TCP connection, which
# `hello` reports as SSH_CONNECTION's would be.
_DIALED: tuple[str, str] | None = None
DIAL_TIMEOUT_S = 60.0


def dial(environ: Any = None) -> socket.socket:
    """`--dial`: connect to the launcher instead of talking on stdin/stdout (agents started by
    srun or mpirun, which cannot carry a private channel). ZERORUN_AGENT_DIAL is
    `HOST[,HOST...]:PORT` (the launcher's addresses; SLURM_LAUNCH_NODE_IPADDR, the launcher's
    address as Slurm saw it, is tried first), ZERORUN_AGENT_TOKEN the job's secret, sent first
    in a `dial` {token, node, hostname, pid} message; `node` is the MPI rank (mpirun's agents,
    also inside a Slurm allocation) or the Slurm node name (SLURMD_NODENAME, srun's agents), by
    which the launcher knows which node this is."""
    global _DIALED
    env = os.environ if environ is None else environ
    target = env.get("ZERORUN_AGENT_DIAL", "")
    token = env.get("ZERORUN_AGENT_TOKEN", "")
    os.environ.pop("ZERORUN_AGENT_TOKEN", None)  # the ranks do not need it
    hosts_text, _, port_text = target.rpartition(":")
    if not port_text.isdigit():
        raise SystemExit(f"zerorun agent: ZERORUN_AGENT_DIAL={target!r} is not HOST[,HOST...]:PORT")
    hosts = [h for h in [env.get("SLURM_LAUNCH_NODE_IPADDR", ""), *hosts_text.split(",")] if h]
    # Open MPI's rank first: mpirun inside a Slurm allocation starts its daemons with srun, so its
    # agents carry SLURMD_NODENAME too (and srun never sets OMPI_*); an srun with
    # MpiDefault=pmix/pmi2 sets PMIX_RANK/PMI_RANK, so the Slurm node name comes before those.
    node = env.get("OMPI_COMM_WORLD_RANK") or env.get("SLURMD_NODENAME") or next(
        (env[v] for v in ("PMIX_RANK", "PMI_RANK") if env.get(v)), socket.gethostname()
    )
    deadline = time.monotonic() + DIAL_TIMEOUT_S
    errors: dict[str, str] = {}
    while True:
        for host in hosts:
            try:
                sock = socket.create_connection((host, int(port_text)), timeout=5)
            except OSError as err:
                errors[host] = str(err.strerror or err)
                continue
            sock.settimeout(None)
            _DIALED = (sock.getpeername()[0], sock.getsockname()[0])
            sock.sendall(wire.encode("dial", token=token, node=node, hostname=socket.gethostname(), pid=os.getpid()))
            return sock
        if time.monotonic() > deadline:
            tried = "; ".join(f"{h}: {e}" for h, e in errors.items())
            raise SystemExit(f"zerorun agent on {socket.gethostname()}: cannot reach the launcher ({tried})")
        time.sleep(0.5)


_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def install_signal_handlers(agent: Agent) -> threading.Thread:
    """SIGTERM / SIGHUP / SIGINT act on a thread of their own, never inside the handler.

    A Python signal handler runs in the main thread between two bytecodes, wherever it was:
    printing from it (or killing ranks, which prints) re-enters a stream whose lock that code may
    hold -- a deadlock or "reentrant call" RuntimeError, and a storm of signals (a scheduler
    retrying) nests handlers inside each other's prints. The handler only writes the signal's
    number to a pipe (one os.write: no lock); `zerorun-agent-signals` reads it and acts."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def on_signal(signum: int, _frame: object) -> None:
        try:
            os.write(write_fd, bytes([signum]))
        except BlockingIOError:
            pass  # hundreds of unhandled signals queued: this one adds nothing

    def dispatch() -> None:
        while True:
            for signum in os.read(read_fd, 64):
                if signum == signal.SIGTERM:
                    agent.preempt()
                else:
                    agent.die(f"got {signal.Signals(signum).name}; killed this node's ranks")

    thread = threading.Thread(target=dispatch, name="zerorun-agent-signals", daemon=True)
    thread.start()
    for sig in _AGENT_SIGNALS:
        signal.signal(sig, on_signal)
    return thread


def main() -> None:
    if sys.argv[1:] == ["--dial"]:
        sock = dial()
        channel_fd = os.dup(sock.fileno())
        stream: Any = sock.makefile("rb")
    else:
        # fd 1 is the channel: keep a private copy for the protocol and point fd 1 at stderr, so a
        # stray print or warning can never corrupt a message.
        channel_fd = os.dup(1)
        os.dup2(2, 1)
        stream = sys.stdin.buffer
    agent = Agent(channel_fd)
    install_signal_handlers(agent)
    _become_subreaper()
    agent.serve(stream)


if __name__ == "__main__":
    main()
