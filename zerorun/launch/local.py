"""The local node runner: starts this machine's ranks and reports what they do (Contract 5).

Each rank is `python -m zerorun.shim ...` in a session of its own (so one `killpg` reaches
the rank and the children it did not detach), with three pipes: stdout, stderr and the event
channel (`ZERORUN_EVENT_FD`). One reader thread multiplexes every pipe of the node with a
selector and watches exits through pidfds (no polling, no SIGCHLD handler), so the main
thread is free for the supervisor. Lines are cut here and posted as one `RankLines` per read of
a pipe; a rank writing faster than the console prints never blocks on its pipe, because this
thread only reads and queues.

Killing is layered, each layer catching what the one before misses:
1. `killpg(SIGKILL)` of every rank's process group;
2. a sweep of every process carrying this job's `ZERORUN_RUN_ID` in its environment (children
   that called setsid, escaping the group), including orphans re-parented to the launcher
   (it is a child subreaper), which are also reaped so no zombie is left.
If the launcher itself is SIGKILLed, the shim's parent-death signal and its sentinel take
over (see `zerorun/shim.py`).
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from zerorun.channel import events
from zerorun.errors import LaunchError
from zerorun.launch.messages import RankEvent, RankExit, RankLines, RankStarted, Sink
from zerorun.launch.plan import DeviceInfo, LaunchPlan, NodePlan, RankSpec, parse_visible_devices

__all__ = ["LocalRunner", "detect_devices", "job_processes", "kill_job_processes", "port_is_free", "choose_free_port"]

_READ_SIZE = 1 << 16
# Rank output pipes get this much room (Linux's default is 64 KiB, ~900 lines): a rank keeps
# printing while the reader sleeps its coalescing pause or the machine is busy. Only the first
# _GROWN_PIPES of a node: pipe capacity counts against the user's pipe-user-pages-soft (64 MiB
# by default), past which Linux gives an unprivileged user's new pipes one page.
_PIPE_SIZE = 1 << 18
_GROWN_PIPES = 32
# A turn of the reader that read less than this waits _COALESCE_S before the next select: ranks
# print a line per write() (the shim line-buffers), so a reader that wakes for every write pays
# a wake-up, a select and a read per line. After the pause one read takes everything written
# meanwhile. Bounded lag (the pause), and a flood (more than this per turn) is read at once.
_COALESCE_BYTES = 1 << 15
_COALESCE_S = 0.002
# A line longer than this is cut (progress bars without newlines, binary junk).
_MAX_LINE = 1 << 16
# An event is cut only when absurdly long (a cut event is lost: it no longer parses).
_MAX_EVENT = 1 << 24
_LINE = re.compile(r"([^\r\n]*)(\r\n|\n|\r)")


@dataclass
class _Stream:
    rank: int
    kind: str  # "stdout" | "stderr" | "events"
    fd: int
    buf: bytearray = field(default_factory=bytearray)


@dataclass
class _Rank:
    spec: RankSpec
    proc: subprocess.Popen[bytes]
    streams: list[_Stream]
    pidfd: int | None
    done: bool = False


class LocalRunner:
    """Runs one node's ranks on this machine."""

    def __init__(
        self,
        plan: LaunchPlan,
        node: NodePlan,
        *,
        python: str = sys.executable,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.plan = plan
        self.node = node
        self.python = python
        self.environ = dict(os.environ if environ is None else environ)
        self._ranks: dict[int, _Rank] = {}
        self._sel = selectors.DefaultSelector()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._killed = False
        self._flush: Callable[[], None] | None = None
        self._grown = 0  # pipes given _PIPE_SIZE

    # -- NodeRunner -------------------------------------------------------------------------

    def start(self, sink: Sink) -> None:
        self._sink = sink
        # A sink that batches (the node agent's `LineBatcher`) is flushed after each turn.
        self._flush = getattr(sink, "flush", None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            for spec in self.node.ranks:
                self._spawn(spec, self.plan.rank_argv(spec, self.python))
        except BaseException:
            self.kill()
            for r in self._ranks.values():  # reap what did start: no zombies
                try:
                    r.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            raise
        self._thread = threading.Thread(target=self._read_loop, name="zerorun-local-reader", daemon=True)
        self._thread.start()

    def signal(self, sig: int, *, tree: bool = True) -> None:
        for r in list(self._ranks.values()):
            if r.proc.returncode is not None:
                continue
            try:
                if tree:
                    os.killpg(r.proc.pid, sig)
                else:
                    os.kill(r.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def kill(self) -> None:
        for r in list(self._ranks.values()):
            try:
                os.killpg(r.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        kill_job_processes(self.plan.run_id, exclude=os.getpid())
        self._killed = True

    def close(self) -> None:
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        for r in self._ranks.values():
            if r.proc.returncode is None:
                try:
                    r.proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
            for s in r.streams:
                _close(s.fd)
            if r.pidfd is not None:
                _close(r.pidfd)
        _close(self._wake_r)
        _close(self._wake_w)
        self._sel.close()
        _reap_adopted({r.proc.pid for r in self._ranks.values()})

    # -- starting ---------------------------------------------------------------------------

    def _spawn(self, spec: RankSpec, argv: list[str]) -> None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        ev_r, ev_w = os.pipe()
        env = dict(self.environ)
        env.update(self.node.env)
        env.update(self.plan.defaults_env(self.node.node_rank, env))
        env.update(self.plan.rank_env(spec, event_fd=ev_w))
        # Lets the shim check it was not orphaned before its parent-death signal was armed.
        env["ZERORUN_LAUNCHER_PID"] = str(os.getpid())
        try:
            proc = subprocess.Popen(
                argv,
                env=env,
                cwd=self.plan.cwd,
                stdin=subprocess.DEVNULL,
                stdout=out_w,
                stderr=err_w,
                pass_fds=(ev_w,),
                start_new_session=True,
            )
        except OSError as err:
            for fd in (out_r, err_r, ev_r):
                _close(fd)
            raise LaunchError(f"cannot start rank {spec.rank} ({argv[0]}): {err}") from err
        finally:
            for fd in (out_w, err_w, ev_w):
                _close(fd)
        streams = [
            _Stream(spec.rank, "stdout", out_r),
            _Stream(spec.rank, "stderr", err_r),
            _Stream(spec.rank, "events", ev_r),
        ]
        for s in streams:
            os.set_blocking(s.fd, False)
            if s.kind != "events" and self._grown < _GROWN_PIPES:
                self._grown += _grow_pipe(s.fd)
        pidfd = _pidfd_open(proc.pid)
        self._ranks[spec.rank] = _Rank(spec, proc, streams, pidfd)
        self._sink(RankStarted(spec.rank, proc.pid))

    # -- the reader thread ------------------------------------------------------------------

    def _read_loop(self) -> None:
        for r in self._ranks.values():
            for s in r.streams:
                self._sel.register(s.fd, selectors.EVENT_READ, s)
            if r.pidfd is not None:
                self._sel.register(r.pidfd, selectors.EVENT_READ, r)
        # Without pidfds, exits are found by polling.
        poll_s = 0.05 if any(r.pidfd is None for r in self._ranks.values()) else None
        while not self._stop.is_set() and not all(r.done for r in self._ranks.values()):
            got = 0
            for key, _ in self._sel.select(timeout=poll_s if poll_s is not None else 1.0):
                if isinstance(key.data, _Stream):
                    if not self._ranks[key.data.rank].done:  # nothing after a rank's RankExit
                        got += self._read(key.data)
                elif isinstance(key.data, _Rank):
                    self._check_exit(key.data)
            if poll_s is not None or self._killed:
                for r in self._ranks.values():
                    if not r.done:
                        self._check_exit(r)
            if got and self._flush is not None:
                self._flush()
            if 0 < got < _COALESCE_BYTES:
                time.sleep(_COALESCE_S)

    def _check_exit(self, r: _Rank) -> None:
        if r.done or r.proc.poll() is None:
            return
        r.done = True
        # Everything the rank wrote before it died comes before its exit.
        for s in r.streams:
            self._read(s, final=True)
            self._unregister(s.fd)
        if r.pidfd is not None:
            self._unregister(r.pidfd)
        self._sink(RankExit(r.spec.rank, r.proc.returncode))

    def _unregister(self, fd: int) -> None:
        try:
            self._sel.unregister(fd)
        except (KeyError, ValueError):
            pass

    def _read(self, s: _Stream, final: bool = False) -> int:
        """Read what the pipe holds (bounded), emit its whole lines; the number of bytes read."""
        got = 0
        # A bounded number of reads per wake-up keeps one chatty rank from starving the others.
        for _ in range(64 if final else 4):
            try:
                data = os.read(s.fd, _READ_SIZE)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                self._unregister(s.fd)
                final = True
                break
            got += len(data)
            s.buf += data
            self._emit_lines(s)
        if final and s.buf:
            self._emit(s, bytes(s.buf))
            s.buf.clear()
        return got

    def _emit_lines(self, s: _Stream) -> None:
        buf = s.buf
        if s.kind == "events":
            end = buf.rfind(b"\n")
            if end >= 0:
                chunk = bytes(buf[:end])
                del buf[: end + 1]
                for line in chunk.split(b"\n"):
                    self._emit(s, line)
        else:
            # A carriage return also ends a line: progress bars (tqdm) redraw with `\r` and
            # never print `\n` until they finish; each redraw becomes a line instead of one
            # huge late line. A `\r` that is the last byte may be half of `\r\n`: wait.
            end = max(buf.rfind(b"\n"), buf.rfind(b"\r", 0, len(buf) - 1))
            if end >= 0:
                chunk = bytes(buf[: end + 1])
                del buf[: end + 1]
                # One decode and one message per chunk, not per line: this is the console's hot
                # path (a message per line cost the launcher more CPU than the ranks' printing).
                text = chunk.decode("utf-8", errors="replace")
                if "\r" not in text:
                    lines = text[:-1].split("\n")
                else:  # a bare `\r` redraw of nothing is skipped
                    lines = [m.group(1) for m in _LINE.finditer(text) if m.group(1) or m.group(2) != "\r"]
                if lines:
                    self._sink(RankLines(s.rank, s.kind, lines))  # type: ignore[arg-type]
        if len(buf) > (_MAX_EVENT if s.kind == "events" else _MAX_LINE):
            self._emit(s, bytes(buf))
            buf.clear()

    def _emit(self, s: _Stream, line: bytes) -> None:
        if s.kind == "events":
            ev = events.decode_line(line)
            if ev is not None:
                self._sink(RankEvent(s.rank, ev))
            return
        text = line.decode("utf-8", errors="replace").replace("\r", "")
        self._sink(RankLines(s.rank, s.kind, (text,)))  # type: ignore[arg-type]


# --- finding and killing a job's processes ------------------------------------------------


def job_processes(run_id: str, *, exclude: int | None = None) -> list[int]:
    """Pids of live processes whose environment carries `ZERORUN_RUN_ID=run_id` (the
    environment is inherited by every descendant that did not wipe it, setsid or not)."""
    needle = f"ZERORUN_RUN_ID={run_id}".encode()
    found: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid == exclude:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                environ = fh.read()
            with open(f"/proc/{pid}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        if needle not in environ.split(b"\0"):
            continue
        if stat.rsplit(b")", 1)[-1].split()[0] == b"Z":
            continue
        found.append(pid)
    return found


def kill_job_processes(run_id: str, *, exclude: int | None = None) -> list[int]:
    pids = job_processes(run_id, exclude=exclude)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return pids


def _reap_adopted(own: set[int]) -> None:
    """Reap children we did not start ourselves: orphans of ranks adopted by the launcher
    (a child subreaper). Only those: reaping our own Popen children here would steal their
    exit status."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        return
    deadline = time.monotonic() + 1.0
    for child in psutil.Process().children():
        if child.pid in own:
            continue
        try:
            ours = child.status() == psutil.STATUS_ZOMBIE or "ZERORUN_RUN_ID" in child.environ()
        except (psutil.Error, OSError):
            ours = False
        if not ours:
            continue
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(child.pid, os.WNOHANG)
            except ChildProcessError:
                break
            if pid:
                break
            time.sleep(0.01)


def _grow_pipe(fd: int) -> int:
    """1 when the pipe got _PIPE_SIZE (0: not Linux, or over the user's pipe quota)."""
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)  # type: ignore[attr-defined]
    except (ImportError, AttributeError, OSError):
        return 0
    return 1


def _pidfd_open(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return None


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


# --- this machine's devices ---------------------------------------------------------------


def detect_devices(environ: Mapping[str, str] | None = None) -> DeviceInfo:
    """GPUs the launcher may use, without importing torch: CUDA_VISIBLE_DEVICES when set
    (entries verbatim, UUIDs included), else the NVIDIA driver's list of GPUs."""
    environ = os.environ if environ is None else environ
    driver = _nvidia_gpu_count()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    visible = parse_visible_devices(environ.get("CUDA_VISIBLE_DEVICES"))
    if visible is not None:
        return DeviceInfo(visible, cores, from_env=True, driver_present=driver > 0)
    return DeviceInfo(tuple(str(i) for i in range(driver)), cores, driver_present=driver > 0)


def _nvidia_gpu_count() -> int:
    root = "/proc/driver/nvidia/gpus"
    try:
        return len(os.listdir(root))
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


# --- the master port ----------------------------------------------------------------------


def port_is_free(port: int) -> bool:
    """Can rank 0's TCPStore listen on `port`? (Bound the way it binds: SO_REUSEADDR, every
    address, IPv4 and IPv6.)"""
    import errno
    import socket

    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((addr, port))
            sock.listen(1)
        except OSError as err:
            if err.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
        finally:
            sock.close()
    return True


def choose_free_port(rng: object | None = None) -> int:
    """A free port for the rendezvous, picked at random *below* the kernel's ephemeral range.

    torchrun's way (bind to port 0, close, hand the number on) returns a port from the
    ephemeral range, which the kernel also hands to every outgoing connection and to every
    other process binding port 0 in that window: a busy machine or parallel test jobs collide.
    Ports below the range are only taken by explicit binds, and a random pick makes two
    launchers choosing at once unlikely to meet.
    """
    import random

    rand = rng if isinstance(rng, random.Random) else random.Random()
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low = int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    lo, hi = (20000, low - 1) if low > 21000 else (low + 1000, 65000)
    for _ in range(200):
        port = rand.randint(lo, hi)
        if port_is_free(port):
            return port
    raise LaunchError(f"no free TCP port found between {lo} and {hi} for the rendezvous; pass --master_port.")
