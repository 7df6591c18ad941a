"""Hostfiles and host selectors: which hosts a job runs on, and which slots on each.

Pure functions, no torch, no I/O beyond reading the hostfile.

Vocabulary: a *slot* is one rank's place on a host (a GPU index on GPU hosts, one CPU rank
otherwise). A `Host` carries the slot indices it will use, so selection only ever narrows
`slots`; `len(host.slots)` is the number of ranks started there and the indices become
`CUDA_VISIBLE_DEVICES` on GPU hosts.

Hostfile grammar (DeepSpeed's, plus per-host environment)::

    # comment
    worker-1 slots=4                 # trailing comments are fine
    worker-2 slots=4 GLOO_SOCKET_IFNAME=eth1 NCCL_SOCKET_IFNAME=eth1

Node order is file order and becomes the node rank; the first host is the master unless the
launcher is told otherwise. `NAME=VALUE` tokens after `slots=` are environment variables for
that host only (DeepSpeed ignores anything after `slots=N`; zerorun uses it for the values
that differ per node, such as the network interface).

Selector grammar (DeepSpeed's `--include` / `--exclude`)::

    worker-1:0,1@worker-2          # slots 0 and 1 of worker-1, all of worker-2
    worker-1:0-3 @ worker-2:4,6-7  # ranges, whitespace tolerated

A bare host means all its slots (in `--include` too: DeepSpeed silently drops it there).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from zerorun.errors import HostfileError
from zerorun.launch.environment import is_plan_variable

__all__ = [
    "Host",
    "parse_hostfile",
    "parse_hostfile_text",
    "parse_selector",
    "select_hosts",
    "local_hosts",
    "is_valid_hostname",
    "LOCAL_HOST_NAMES",
]

# Names that mean "this machine" when there is no hostfile (DeepSpeed's resource pool uses
# `localhost`).
LOCAL_HOST_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})

# A host name, IPv4 address or ssh alias. It must not start with `-` (ssh would read it as an
# option) and carries no shell metacharacters, `@` or `:` (those are selector syntax).
_HOSTNAME = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.\-]*[A-Za-z0-9_])?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SLOTS = re.compile(r"^slots=(.*)$")


@dataclass(frozen=True)
class Host:
    """One node of a job: its name (as the hostfile spells it), slot indices and own env."""

    name: str
    slots: tuple[int, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    # Where the host came from, for messages ("hostfile:3"); None for implicit localhost.
    origin: str | None = None

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def is_local(self) -> bool:
        return self.name in LOCAL_HOST_NAMES


def is_valid_hostname(name: str) -> bool:
    return bool(_HOSTNAME.match(name))


def local_hosts(num_slots: int) -> list[Host]:
    """The resource pool of a job without a hostfile: `localhost` with `num_slots` slots."""
    return [Host("localhost", tuple(range(num_slots)))]


def parse_hostfile(path: str | Path) -> list[Host]:
    """Read a hostfile; a missing file is an error (DeepSpeed silently runs locally instead)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise HostfileError(
            f"hostfile {path} does not exist. Give the path of a file with one `HOST slots=N` "
            "line per node (see hostfiles/ in the zerorun repository), or leave out --hostfile "
            "to run on this machine only."
        )
    if not p.is_file():
        raise HostfileError(f"hostfile {path} is not a file (it is a directory or a device).")
    try:
        text = p.read_text(encoding="utf-8-sig")  # -sig: a BOM from a Windows editor is dropped
    except (OSError, UnicodeDecodeError) as err:
        raise HostfileError(f"cannot read hostfile {path}: {err}") from err
    return parse_hostfile_text(text, source=str(path))


def parse_hostfile_text(text: str, *, source: str = "<hostfile>") -> list[Host]:
    """The hosts of a hostfile's text. Every bad line is reported, not only the first: one
    HostfileError with the failure table (`fanout.failure_table`: the line and its host, what is
    wrong, the fix), as the preflight reports nodes."""
    from zerorun.launch.fanout import Failed, failure_table

    hosts: list[Host] = []
    seen: dict[str, int] = {}
    bad: dict[str, Failed[str]] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        name = line.split()[0]
        try:
            host = _parse_line(line, raw, where, seen)
        except _LineError as err:
            bad[where] = Failed(f"{where} {name}", err.category, str(err), 1)
            continue
        seen[host.name] = lineno
        hosts.append(host)
    if bad:
        raise HostfileError(failure_table(bad, what=f"hostfile {source}", unit="line") + "\nNothing was started.")
    if not hosts:
        raise HostfileError(
            f"hostfile {source} lists no hosts (only blank lines or comments). "
            "Add one `HOST slots=N` line per node."
        )
    return hosts


class _LineError(Exception):
    """One bad hostfile line: its category (the table's problem column) and message."""

    def __init__(self, category: str, message: str) -> None:
        super().__init__(message)
        self.category = category


def _parse_line(line: str, raw: str, where: str, seen: dict[str, int]) -> Host:
    tokens = line.split()
    name = tokens[0]
    if not is_valid_hostname(name):
        hint = (
            " For an IPv6 address or user@host, use an alias from ~/.ssh/config (HostName, User)."
            if ":" in name or "@" in name
            else ""
        )
        raise _LineError(
            "host name",
            f"{name!r} is not a host name. Use letters, digits, '-', '_' and '.', "
            f"not starting with '-' (the line must read `HOST slots=N`).{hint}",
        )
    if name in seen:
        raise _LineError(
            "listed twice",
            f"host {name!r} is listed twice (first on line {seen[name]}). "
            "List each node once, with all its slots: `HOST slots=N`.",
        )
    if len(tokens) < 2 or not _SLOTS.match(tokens[1]):
        raise _LineError(
            "slots",
            f"host {name!r} has no `slots=N` (the line reads {raw.strip()!r}). "
            f"Write `{name} slots=N`, N = the number of GPUs (or CPU ranks) on that node.",
        )
    slots = _parse_slot_count(_SLOTS.match(tokens[1]).group(1), name)  # type: ignore[union-attr]
    env = _parse_host_env(tokens[2:], name)
    return Host(name, tuple(range(slots)), env, where)


def _parse_slot_count(text: str, name: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise _LineError(
            "slots", f"slots={text!r} for host {name!r} is not a whole number. Write e.g. `{name} slots=8`."
        ) from None
    if slots < 0:
        raise _LineError("slots", f"slots={slots} for host {name!r} is negative. It must be at least 1.")
    if slots == 0:
        raise _LineError(
            "slots",
            f"host {name!r} has slots=0. Comment the line out (`# {name} ...`) "
            "or use --exclude to leave a node out.",
        )
    return slots


def _parse_host_env(tokens: Sequence[str], name: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for token in tokens:
        key, sep, value = token.partition("=")
        if not sep or not _ENV_NAME.match(key):
            raise _LineError(
                "environment",
                f"unexpected {token!r} after the slots of host {name!r}. Only "
                "`NAME=VALUE` environment settings for that host may follow `slots=N`.",
            )
        if key == "slots":
            raise _LineError("slots", f"host {name!r} gives slots= twice.")
        if is_plan_variable(key):
            raise _LineError(
                "environment",
                f"{key} is set by the launcher for each node or rank and cannot be "
                f"given for host {name!r}. Remove it from the hostfile.",
            )
        env[key] = value
    return env


def parse_selector(text: str, *, option: str = "--include") -> dict[str, tuple[int, ...] | None]:
    """`host1:0,2-3@host2` -> {"host1": (0, 2, 3), "host2": None}; None = all slots."""
    spec = text.strip()
    if not spec:
        raise HostfileError(f"{option} is empty; write e.g. {option} 'worker-1:0,1@worker-2'.")
    result: dict[str, tuple[int, ...] | None] = {}
    for part in spec.split("@"):
        # Whitespace is tolerated around '@', ':', ',' and '-', never inside a host name.
        part = part.strip()
        if not part:
            raise HostfileError(
                f"{option} {text!r} has an empty entry (a stray '@'); hosts are separated by "
                "single '@', e.g. 'worker-1:0,1@worker-2'."
            )
        name, sep, slot_text = part.partition(":")
        name = name.strip()
        slot_text = "".join(slot_text.split())
        if not is_valid_hostname(name):
            raise HostfileError(f"{option} {text!r}: {name!r} is not a host name.")
        slots = _parse_slot_list(slot_text, option, text, name) if sep else None
        if name in result:
            raise HostfileError(
                f"{option} {text!r} names host {name!r} twice; put all its slots in one entry "
                f"({name}:0,1)."
            )
        result[name] = slots
    return result


def _parse_slot_list(slot_text: str, option: str, text: str, name: str) -> tuple[int, ...]:
    if not slot_text:
        raise HostfileError(
            f"{option} {text!r}: no slots after '{name}:'; list them ({name}:0,1 or {name}:0-3) "
            f"or write just {name} for all of them."
        )
    slots: list[int] = []
    for item in slot_text.split(","):
        lo_text, dash, hi_text = item.partition("-")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if dash else lo
        except ValueError:
            raise HostfileError(
                f"{option} {text!r}: {item!r} is not a slot index or range (write 0,1 or 0-3)."
            ) from None
        if lo < 0 or hi < lo:
            raise HostfileError(f"{option} {text!r}: {item!r} is not a valid slot range (write 0-3).")
        slots.extend(range(lo, hi + 1))
    if len(set(slots)) != len(slots):
        raise HostfileError(f"{option} {text!r}: host {name!r} lists a slot more than once.")
    return tuple(sorted(slots))


def select_hosts(
    pool: Sequence[Host],
    *,
    include: str | None = None,
    exclude: str | None = None,
    num_nodes: int | None = None,
    num_gpus: int | None = None,
    source: str = "the hostfile",
) -> list[Host]:
    """Narrow a resource pool: include/exclude selectors, then the first `num_nodes` hosts and
    the first `num_gpus` slots of each. Hosts left with no slots are dropped; an empty result is
    an error. Order (= node rank) always follows the pool."""
    if include and exclude:
        raise HostfileError("--include and --exclude cannot be used together; use one of them.")
    by_name = {h.name: h for h in pool}
    hosts = list(pool)
    if include:
        wanted = parse_selector(include, option="--include")
        _check_selected(wanted, by_name, "--include", source)
        hosts = [
            replace(h, slots=h.slots if wanted[h.name] is None else wanted[h.name])  # type: ignore[arg-type]
            for h in pool
            if h.name in wanted
        ]
    elif exclude:
        unwanted = parse_selector(exclude, option="--exclude")
        _check_selected(unwanted, by_name, "--exclude", source)
        hosts = []
        for h in pool:
            drop = unwanted.get(h.name, ())
            if drop is None:
                continue
            kept = tuple(s for s in h.slots if s not in drop)
            if kept:
                hosts.append(replace(h, slots=kept))
    if num_nodes is not None:
        if num_nodes < 1:
            raise HostfileError(f"--num_nodes must be at least 1 (got {num_nodes}).")
        if num_nodes > len(hosts):
            raise HostfileError(
                f"--num_nodes {num_nodes} but only {len(hosts)} node(s) are available after "
                f"selection ({', '.join(h.name for h in hosts)})."
            )
        hosts = hosts[:num_nodes]
    if num_gpus is not None:
        if num_gpus < 1:
            raise HostfileError(f"--num_gpus must be at least 1 (got {num_gpus}).")
        short = [h for h in hosts if h.num_slots < num_gpus]
        if short:
            listing = ", ".join(f"{h.name} has {h.num_slots}" for h in short)
            raise HostfileError(
                f"--num_gpus {num_gpus} asks for {num_gpus} slots per node, but {listing}. "
                "Lower --num_gpus or raise slots= in the hostfile."
            )
        hosts = [replace(h, slots=h.slots[:num_gpus]) for h in hosts]
    if not hosts:
        raise HostfileError(f"the selection leaves no host to run on (from {source}).")
    return hosts


def _check_selected(
    selector: Mapping[str, tuple[int, ...] | None], by_name: Mapping[str, Host], option: str, source: str
) -> None:
    for name, slots in selector.items():
        host = by_name.get(name)
        if host is None:
            known = ", ".join(by_name) or "none"
            raise HostfileError(f"{option} names host {name!r}, which is not in {source} (hosts: {known}).")
        if slots is None:
            continue
        bad = [s for s in slots if s not in host.slots]
        if bad:
            raise HostfileError(
                f"{option}: slot(s) {', '.join(map(str, bad))} of host {name!r} do not exist; "
                f"it has slots {_ranges(host.slots)}."
            )


def _ranges(slots: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> '0-2,5' for messages."""
    out: list[str] = []
    start = prev = None
    for s in slots:
        if start is None:
            start = prev = s
        elif s == prev + 1:  # type: ignore[operator]
            prev = s
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = s
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out) or "none"
