"""The first code in every rank: `python -m zerorun.shim SCRIPT ARGS` (or `-m MODULE ARGS`).

It prepares the process, then runs the user's script exactly as `python SCRIPT ARGS` would
(`__name__ == "__main__"`, `sys.argv`, the script's directory first on `sys.path`, exit
codes and exceptions preserved). Before that, and cheaply (stdlib only; torch is imported
only on GPU jobs, which need it to pick the device):

- ties the rank to the launcher: a parent-death signal (SIGKILL, so a rank blocked in a
  collective dies too) and a *sentinel*, a forked copy of this process that does nothing but
  wait for the rank to die and then kill what the rank leaves behind: its process group and
  every process carrying this rank's `ZERORUN_RUN_ID`/`RANK` (children that called setsid);
- installs faulthandler (fatal signals, and an all-thread stack dump on SIGUSR1: the
  launcher's `--hang_timeout` asks for it);
- connects the event channel (`zerorun.channel.events`), reports an uncaught exception as an
  `error` event, and sends a `memory` event every `zerorun.memory_report_interval` seconds of
  the config (default 5; `ZERORUN_MEMORY_REPORT_INTERVAL` overrides it) and at exit;
- started by srun or the user's own mpirun (no RANK), exports the torchrun variables from the
  scheduler's (`runtime/world.py`), MASTER_ADDR included;
- on GPU jobs calls `torch.cuda.set_device(LOCAL_RANK // ZERORUN_RANKS_PER_GPU)`;
- with `ZERORUN_DEEPSPEED_COMPAT=1` (`zerorun --deepspeed-compat`) makes `import deepspeed`
  resolve to zerorun's compatibility layer (`zerorun.compat`, stdlib-only until imported).

It does not create the process group: `zerorun.initialize` creates one only if the script has
not (torchrun-style scripts that call `init_process_group` themselves run unchanged). The
launcher's config reaches `zerorun.initialize` through `ZERORUN_CONFIG_JSON`.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import resource
import runpy
import signal
import sys
import threading
import traceback
from typing import Any, NoReturn

from zerorun.channel import events

__all__ = ["main", "memory_snapshot"]

_PR_SET_PDEATHSIG = 1
# The sentinel's wake-up call; a real-time signal nobody else sends to this process group.
_SENTINEL_SIGNAL = signal.SIGRTMIN + 3
_DEFAULT_MEMORY_INTERVAL_S = 5.0
_MAX_TRACEBACK = 1 << 16
_USAGE = "usage: python -m zerorun.shim SCRIPT [ARGS...] | -m MODULE [ARGS...]"

_gpu_index: int | None = None


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or (args[0] == "-m" and len(args) < 2):
        print(_USAGE, file=sys.stderr)
        sys.exit(2)
    _tie_to_launcher()
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    for stream in (sys.stdout, sys.stderr):
        # Pipes are block-buffered by default: lines would reach the console late and out of
        # order with stderr. One write per line also keeps lines whole for the launcher.
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    if events.connect():
        # Programs this rank starts must not take some unrelated descriptor with that number
        # for the channel.
        os.environ.pop(events.ENV_VAR, None)
    _adopt_scheduler_ranks()
    _select_device()
    if os.environ.get("ZERORUN_DEEPSPEED_COMPAT") == "1":
        # `zerorun --deepspeed-compat`: `import deepspeed` is zerorun's layer (Contract 8).
        from zerorun.compat import activate

        activate()
    interval = _memory_interval()
    if events.connected() and interval > 0:
        threading.Thread(target=_report_memory, args=(interval,), name="zerorun-memory", daemon=True).start()
    code = 0
    try:
        _run_target(args)
    except SystemExit as exc:
        code = _exit_status(exc)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - reported, printed like Python does, exit 1
        tb = _user_frames(exc.__traceback__)
        exc = exc.with_traceback(tb)
        events.emit(
            "error",
            type=type(exc).__name__,
            message=str(exc),
            # The end of a traceback is what matters; a RecursionError's can be megabytes.
            traceback="".join(traceback.format_exception(type(exc), exc, tb))[-_MAX_TRACEBACK:],
        )
        sys.excepthook(type(exc), exc, tb)
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "deepspeed":
            # The likeliest first mistake of a DeepSpeed user (Contract 8).
            sys.stderr.write(
                "zerorun: this script imports deepspeed: launch it with `zerorun --deepspeed-compat ...` to "
                "run it on zerorun's DeepSpeed compatibility layer (no DeepSpeed install needed)\n"
            )
        code = 1
    finally:
        if events.connected():
            events.emit("memory", final=True, **memory_snapshot())
    _finish(code)


def _exit_status(exc: SystemExit) -> int:
    """The status `python SCRIPT` exits with for this SystemExit (a message means 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _finish(code: int) -> NoReturn:
    """Exit with the script's status, doing Python's part of shutdown and skipping the rest.

    torch's gloo process group can abort the interpreter's final teardown ("terminate called
    without an active exception", SIGABRT) when a script exits without destroying it -- e.g.
    `sys.exit(3)` after a peer failed -- and the launcher would then report SIGABRT instead of
    the script's own status. So: join non-daemon threads and run atexit handlers as
    Py_Finalize would, flush Python's and C's buffers, then `os._exit`.
    """
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize calls first
    except Exception:  # noqa: BLE001 - best effort; exiting matters more
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)  # native code's buffered stdio (e.g. printf from C++)
    except (OSError, AttributeError):
        pass
    os._exit(code)


def _run_target(args: list[str]) -> None:
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        sys.argv = [module, *rest]  # run_module replaces argv[0] with the module's file
        # `python -m` puts the working directory first; `python -m zerorun.shim` already did.
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, rest = args[0], args[1:]
    sys.argv = [script, *rest]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


def _user_frames(tb: Any) -> Any:
    """Drop the shim's and runpy's own frames from a traceback, as `python SCRIPT` shows it."""
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not (name.startswith("<frozen runpy") or os.path.abspath(name) in ours):
            break
        tb = tb.tb_next
    return tb


# --- tying the rank (and its children) to the launcher ------------------------------------


def _prctl(option: int, value: int) -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _tie_to_launcher() -> None:
    launcher = os.environ.get("ZERORUN_LAUNCHER_PID")
    if launcher is None:
        return  # not started by a launcher (someone ran the shim by hand)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if str(os.getppid()) != launcher:
        # The launcher died before the signal was armed.
        os._exit(1)
    _start_sentinel()


def _start_sentinel() -> None:
    run_id = os.environ.get("ZERORUN_RUN_ID")
    rank = os.environ.get("RANK")
    if not run_id or rank is None:
        return
    rank_pid = os.getpid()
    pgid = os.getpgrp()
    # Block the wake-up signal before forking so it cannot arrive before sigwait.
    signal.pthread_sigmask(signal.SIG_BLOCK, {_SENTINEL_SIGNAL})
    pid = os.fork()
    if pid:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {_SENTINEL_SIGNAL})
        return
    try:
        # The launcher's TERM/INT to the group are for the rank; a stack-dump request too.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_IGN)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.closerange(3, 1 << 16)  # pipes held here would keep the rank's output open
        if _prctl(_PR_SET_PDEATHSIG, _SENTINEL_SIGNAL) and os.getppid() == rank_pid:
            signal.sigwait({_SENTINEL_SIGNAL})
        _kill_leftovers(run_id, rank, pgid)
    finally:
        os._exit(0)


def _kill_leftovers(run_id: str, rank: str, pgid: int) -> None:
    me = os.getpid()
    tags = {f"ZERORUN_RUN_ID={run_id}".encode(), f"RANK={rank}".encode()}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                environ = set(fh.read().split(b"\0"))
        except OSError:
            continue
        if tags <= environ:
            try:
                os.kill(int(name), signal.SIGKILL)
            except OSError:
                pass
    try:
        os.killpg(pgid, signal.SIGKILL)  # the group, this sentinel included
    except OSError:
        pass


# --- device and memory --------------------------------------------------------------------


def _adopt_scheduler_ranks() -> None:
    """Started by srun or the user's own mpirun (no RANK): export the torchrun variables, the
    master included (`runtime/world.py`: rank 0's host from PMIx on several hosts), so a script
    written for torchrun runs unchanged. Nothing to do under zerorun or torchrun."""
    if "RANK" in os.environ:
        return
    from zerorun.errors import ZerorunError
    from zerorun.runtime.world import torchrun_env

    try:
        os.environ.update(torchrun_env(os.environ))
    except ZerorunError as err:
        print(f"zerorun: {err}", file=sys.stderr)
        sys.exit(1)


def _select_device() -> None:
    global _gpu_index
    if os.environ.get("ZERORUN_DEVICE") != "cuda":
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    per_gpu = max(1, int(os.environ.get("ZERORUN_RANKS_PER_GPU", "1")))
    import torch  # a GPU job needs it anyway; CPU jobs never pay for it here

    _gpu_index = local_rank // per_gpu
    torch.cuda.set_device(_gpu_index)


def _memory_interval() -> float:
    override = os.environ.get("ZERORUN_MEMORY_REPORT_INTERVAL")
    if override:
        try:
            return float(override)
        except ValueError:
            pass
    text = os.environ.get("ZERORUN_CONFIG_JSON")
    if text:
        try:
            section = json.loads(text).get("zerorun") or {}
            value = section.get("memory_report_interval")
            if isinstance(value, (int, float)):
                return float(value)
        except (ValueError, AttributeError):
            pass
    return _DEFAULT_MEMORY_INTERVAL_S


def memory_snapshot() -> dict[str, Any]:
    """Host RSS (now and peak), GPU memory of the rank's device if torch is already imported
    and CUDA initialised (never imports torch), and the runtime's breakdown if registered."""
    snap: dict[str, Any] = {}
    try:
        # VmRSS / VmHWM (peak) come from the same kernel counters, so peak >= current.
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key = "rss" if line.startswith("VmRSS") else "rss_peak"
                    snap[key] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if "rss_peak" not in snap:
        snap["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                dev = _gpu_index if _gpu_index is not None else torch.cuda.current_device()
                snap["gpu"] = {
                    "allocated": int(torch.cuda.memory_allocated(dev)),
                    "reserved": int(torch.cuda.memory_reserved(dev)),
                    "peak": int(torch.cuda.max_memory_allocated(dev)),
                }
        except Exception:  # noqa: BLE001 - a broken CUDA context must not kill the report
            pass
    provider = events.memory_provider()
    if provider is not None:
        try:
            snap["breakdown"] = dict(provider())
        except Exception as exc:  # noqa: BLE001
            snap["breakdown_error"] = f"{type(exc).__name__}: {exc}"
    return snap


def _report_memory(interval: float) -> None:
    stop = threading.Event()
    while not stop.wait(interval):
        events.emit("memory", **memory_snapshot())


if __name__ == "__main__":
    main()
