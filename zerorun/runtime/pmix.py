"""What the PMIx server knows about this job, read through libpmix with ctypes (stdlib only).

Open MPI 4/5 (ORTE, PRRTE), `prterun` and `srun --mpi=pmix` start every process as a PMIx
client: `PMIX_NAMESPACE` and `PMIX_RANK` are set, and the local PMIx server answers questions
about the job. zerorun asks for what the environment does not say: the job size, this process's
local rank and local size, and the host name of rank 0, the master of a job that a user
started on several hosts with their own `mpirun` (no `MASTER_ADDR` anywhere).

`PMIx_Init` then `PMIx_Finalize`: a client that exits without finalizing is reported by
Open MPI as a process that "exited without calling finalize", and the job fails. PMIx counts
initializations, so a later `MPI_Init` (mpi4py) in the same process still works. Anything that
goes wrong (no libpmix, no server, a key missing) gives None: callers then ask the user for
`MASTER_ADDR`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["PmixJob", "job", "is_client"]

# pmix_common.h: PMIX_MAX_NSLEN, PMIX_RANK_WILDCARD, the data types read here and the keys.
_NSLEN = 255
_RANK_WILDCARD = 0xFFFFFFFE
_STRING = 3
_INTEGERS: dict[int, type[ctypes._SimpleCData]] = {  # type: ignore[type-arg]
    4: ctypes.c_size_t,  # PMIX_SIZE
    6: ctypes.c_int,  # PMIX_INT
    9: ctypes.c_int32,
    10: ctypes.c_int64,
    11: ctypes.c_uint,  # PMIX_UINT
    12: ctypes.c_uint8,
    13: ctypes.c_uint16,  # PMIX_UINT16 (local rank)
    14: ctypes.c_uint32,  # PMIX_UINT32 (job size, local size)
    15: ctypes.c_uint64,
}
_JOB_SIZE = b"pmix.job.size"
_LOCAL_SIZE = b"pmix.local.size"
_LOCAL_RANK = b"pmix.lrank"
_HOSTNAME = b"pmix.hname"


class _Proc(ctypes.Structure):
    _fields_ = [("nspace", ctypes.c_char * (_NSLEN + 1)), ("rank", ctypes.c_uint32)]


@dataclass(frozen=True)
class PmixJob:
    rank: int
    size: int
    local_rank: int
    local_size: int | None
    rank0_host: str | None


_cache: dict[tuple[str, str], PmixJob | None] = {}


def is_client(env: Mapping[str, str]) -> bool:
    """Whether this process was started by a PMIx server (Open MPI, PRRTE, srun --mpi=pmix)."""
    return bool(env.get("PMIX_NAMESPACE")) and (env.get("PMIX_RANK") or "").isdigit()


def _library() -> ctypes.CDLL | None:
    """libpmix: ZERORUN_PMIX_LIBRARY (a path or soname) if set, else the system's. A library
    without the PMIx client calls (a wrong path) is passed over like a missing one: looking up
    an absent symbol raises AttributeError, a traceback in every rank of the user's mpirun."""
    names = [os.environ.get("ZERORUN_PMIX_LIBRARY"), ctypes.util.find_library("pmix"), "libpmix.so.2", "libpmix.so"]
    for name in names:
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        if all(hasattr(lib, f) for f in ("PMIx_Init", "PMIx_Get", "PMIx_Finalize")):
            return lib
    return None


def _value(lib: ctypes.CDLL, proc: _Proc, key: bytes) -> int | str | None:
    """One PMIx_Get; the value (an integer or a string) or None."""
    out = ctypes.c_void_p()
    rc = lib.PMIx_Get(ctypes.byref(proc), key, None, ctypes.c_size_t(0), ctypes.byref(out))
    if rc != 0 or not out.value:
        return None
    # pmix_value_t: a uint16 type, then the data union at offset 8 (it holds pointers and
    # 64-bit numbers, so it is 8-byte aligned). The value is left to the library (a few bytes).
    kind = ctypes.c_uint16.from_address(out.value).value
    if kind == _STRING:
        raw = ctypes.c_char_p.from_address(out.value + 8).value
        return raw.decode(errors="replace") if raw else None
    ctype = _INTEGERS.get(kind)
    return int(ctype.from_address(out.value + 8).value) if ctype is not None else None


def job(env: Mapping[str, str] | None = None) -> PmixJob | None:
    """This process's view of its PMIx job, asked once per process; None when not a PMIx client
    or when the server cannot be asked."""
    env = os.environ if env is None else env
    if not is_client(env):
        return None
    key = (env["PMIX_NAMESPACE"], env["PMIX_RANK"])
    if key not in _cache:
        _cache[key] = _ask()
    return _cache[key]


def _ask() -> PmixJob | None:
    lib = _library()
    if lib is None:
        return None
    me = _Proc()
    if lib.PMIx_Init(ctypes.byref(me), None, ctypes.c_size_t(0)) != 0:
        return None
    try:
        wildcard = _Proc(me.nspace, _RANK_WILDCARD)
        size = _value(lib, wildcard, _JOB_SIZE)
        local_size = _value(lib, wildcard, _LOCAL_SIZE)
        local_rank = _value(lib, _Proc(me.nspace, me.rank), _LOCAL_RANK)
        host = _value(lib, _Proc(me.nspace, 0), _HOSTNAME)
    finally:
        lib.PMIx_Finalize(None, ctypes.c_size_t(0))
    if not isinstance(size, int):
        return None
    return PmixJob(
        rank=int(me.rank),
        size=size,
        local_rank=local_rank if isinstance(local_rank, int) else 0,
        local_size=local_size if isinstance(local_size, int) else None,
        rank0_host=host if isinstance(host, str) and host else None,
    )
