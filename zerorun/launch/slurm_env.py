"""What a Slurm job tells its processes: host lists and the `SLURM_*` variables, parsed.

Pure functions, stdlib only, no torch. Every malformed value raises a `LaunchError` that
names the variable (or the text) and shows what was expected, never a traceback.

Host lists (`SLURM_JOB_NODELIST`, `scontrol show hostnames`)::

    gpu[01-04,07],cpu-a[1-2]   -> gpu01 gpu02 gpu03 gpu04 gpu07 cpu-a1 cpu-a2
    rack[1-2]-n[1-2]           -> rack1-n1 rack1-n2 rack2-n1 rack2-n2  (several brackets: product)
    a[1-2]b                    -> error, as in Slurm (text after a range only before another [...])
    n[8-10]                    -> n8 n9 n10     (no padding: the lower bound has no leading 0)
    n[098-101]                 -> n098 n099 n100 n101 (width of the lower bound)

Commas inside brackets belong to the range; commas outside separate host expressions.

Counts per node (`SLURM_TASKS_PER_NODE`, `SLURM_JOB_CPUS_PER_NODE`)::

    8(x4),4   -> [8, 8, 8, 8, 4]
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from zerorun.errors import LaunchError

__all__ = [
    "expand_hostlist",
    "compress_hostlist",
    "expand_counts",
    "SlurmEnv",
    "read_slurm_env",
    "slurm_job_id",
]

# A name may not be absurdly long; a range may not expand into millions of hosts by a typo.
_MAX_HOSTS = 1_000_000
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
_NAME_CHARS = re.compile(r"^[A-Za-z0-9_.\-]*$")


def _fail(source: str, text: str, why: str) -> LaunchError:
    return LaunchError(f"{source}={text!r} is not a valid Slurm host list: {why}.")


def expand_hostlist(text: str, *, source: str = "host list") -> list[str]:
    """`gpu[01-04,07],cpu-a[1-2]` -> every host name, in Slurm's order (duplicates kept, as
    `scontrol show hostnames` keeps them). `source` names the variable in errors."""
    text = text.strip()
    if not text:
        raise _fail(source, text, "it is empty")
    hosts: list[str] = []
    for item in _split_top(text, source):
        hosts.extend(_expand_one(item, text, source))
        if len(hosts) > _MAX_HOSTS:
            raise _fail(source, text, f"it names more than {_MAX_HOSTS} hosts")
    return hosts


def _split_top(text: str, source: str) -> list[str]:
    """Split at commas outside brackets."""
    items: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise _fail(source, text, "brackets cannot nest")
            depth = 1
        elif ch == "]":
            if not depth:
                raise _fail(source, text, f"']' at position {i} has no '['")
            depth = 0
        elif ch == "," and not depth:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise _fail(source, text, "a '[' is never closed")
    items.append(text[start:])
    for item in items:
        if not item.strip():
            raise _fail(source, text, "it has an empty entry (two commas, or a comma at an end)")
    return [i.strip() for i in items]


def _expand_one(item: str, text: str, source: str) -> list[str]:
    # Alternate literal parts and bracket groups: "rack", "1-2", "-n", "1-2", "".
    parts = re.split(r"\[([^\]]*)\]", item)
    if len(parts) > 1 and parts[-1]:
        # Slurm's own rule: text may follow a range only when another [...] comes after it.
        raise _fail(source, text, f"{parts[-1]!r} follows the last ']' (Slurm allows text after a range only before another [...])")
    names = [""]
    for index, part in enumerate(parts):
        if index % 2 == 0:
            if not _NAME_CHARS.match(part):
                raise _fail(source, text, f"{part!r} is not part of a host name")
            names = [n + part for n in names]
        else:
            values = _expand_ranges(part, text, source)
            if len(names) * len(values) > _MAX_HOSTS:
                raise _fail(source, text, f"it names more than {_MAX_HOSTS} hosts")
            names = [n + v for n in names for v in values]
    if any(not n for n in names):
        raise _fail(source, text, "it has an empty host name")
    return names


def _expand_ranges(body: str, text: str, source: str) -> list[str]:
    if not body.strip():
        raise _fail(source, text, "'[]' is empty")
    out: list[str] = []
    for piece in body.split(","):
        piece = piece.strip()
        m = _RANGE.match(piece)
        if not m:
            raise _fail(source, text, f"{piece!r} inside [...] is not a number or a range like 01-04")
        lo_text, hi_text = m.group(1), m.group(2)
        lo = int(lo_text)
        hi = int(hi_text) if hi_text is not None else lo
        if hi < lo:
            raise _fail(source, text, f"the range {piece!r} goes backwards")
        if hi - lo >= _MAX_HOSTS:
            raise _fail(source, text, f"the range {piece!r} names more than {_MAX_HOSTS} hosts")
        # Slurm pads to the width of the lower bound ("01-10" -> 01..10, "8-10" -> 8, 9, 10).
        width = len(lo_text) if lo_text.startswith("0") and len(lo_text) > 1 else 0
        out.extend(str(v).zfill(width) for v in range(lo, hi + 1))
    return out


def compress_hostlist(hosts: list[str]) -> str:
    """The reverse, for messages and `srun --nodelist`: runs of consecutive numbered names with
    one prefix and width become `prefix[a-b,...]`. Order is kept (only neighbours merge)."""
    groups: list[tuple[str, int, list[int]] | str] = []
    for name in hosts:
        m = re.match(r"^(.*?)(\d+)$", name)
        if not m:
            groups.append(name)
            continue
        prefix, digits = m.group(1), m.group(2)
        width = len(digits) if digits.startswith("0") and len(digits) > 1 else 0
        last = groups[-1] if groups else None
        if isinstance(last, tuple) and last[0] == prefix and last[1] == width and int(digits) > last[2][-1]:
            last[2].append(int(digits))
        else:
            groups.append((prefix, width, [int(digits)]))
    out: list[str] = []
    for g in groups:
        if isinstance(g, str):
            out.append(g)
            continue
        prefix, width, nums = g
        if len(nums) == 1:
            out.append(f"{prefix}{str(nums[0]).zfill(width)}")
            continue
        spans: list[str] = []
        start = prev = nums[0]
        for n in [*nums[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            a, b = str(start).zfill(width), str(prev).zfill(width)
            spans.append(a if start == prev else f"{a}-{b}")
            if n is not None:
                start = prev = n
        out.append(f"{prefix}[{','.join(spans)}]")
    return ",".join(out)


def expand_counts(text: str, *, source: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """`8(x4),4` -> [8, 8, 8, 8, 4]."""
    text = text.strip()
    if not text:
        raise LaunchError(f"{source} is empty; expected counts like 8(x4),4.")
    out: list[int] = []
    for piece in text.split(","):
        m = _COUNT.match(piece.strip())
        if not m:
            raise LaunchError(
                f"{source}={text!r}: {piece.strip()!r} is not a count; expected counts like 8(x4),4 "
                "(8 on each of 4 nodes, then 4)."
            )
        value, repeat = int(m.group(1)), int(m.group(2) or 1)
        if repeat < 1:
            raise LaunchError(f"{source}={text!r}: {piece.strip()!r} repeats a count zero times.")
        if repeat > _MAX_HOSTS:
            raise LaunchError(f"{source}={text!r}: {piece.strip()!r} names more than {_MAX_HOSTS} nodes.")
        out.extend([value] * repeat)
    return out


@dataclass(frozen=True)
class SlurmEnv:
    """The Slurm variables zerorun uses, parsed. `None`: not set."""

    job_id: str | None = None
    step_id: str | None = None
    nodes: tuple[str, ...] = ()  # SLURM_JOB_NODELIST expanded
    num_nodes: int | None = None  # SLURM_JOB_NUM_NODES / SLURM_NNODES
    tasks_per_node: tuple[int, ...] | None = None  # SLURM_TASKS_PER_NODE expanded
    ntasks: int | None = None  # SLURM_NTASKS (of the step, inside one)
    node_id: int | None = None  # SLURM_NODEID: this node's index in the step
    proc_id: int | None = None  # SLURM_PROCID
    step_nodes: tuple[str, ...] = ()  # SLURM_STEP_NODELIST expanded (inside a step)
    step_num_nodes: int | None = None  # SLURM_STEP_NUM_NODES

    @property
    def in_allocation(self) -> bool:
        return self.job_id is not None

    @property
    def in_step(self) -> bool:
        """Inside `srun` (a step), not only an allocation. The batch script itself runs in the
        "batch" step, which does not count: it is the allocation's shell."""
        return self.step_id is not None and self.step_id not in ("batch", "extern", "interactive")


def _int_var(environ: Mapping[str, str], name: str, *, minimum: int = 0) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not a whole number (Slurm sets it to one).") from None
    if value < minimum:
        raise LaunchError(f"{name}={raw!r} must be at least {minimum}.")
    return value


def slurm_job_id(environ: Mapping[str, str]) -> str | None:
    """The allocation this process runs in, if any: SLURM_JOB_ID, or SLURM_JOBID (the older
    name, which Slurm still sets beside it and some site wrappers set alone)."""
    return environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or None


def read_slurm_env(environ: Mapping[str, str]) -> SlurmEnv:
    """Parse the Slurm variables of `environ`; a malformed value raises LaunchError naming it."""
    job_id = slurm_job_id(environ)
    nodelist_name = next((n for n in ("SLURM_JOB_NODELIST", "SLURM_NODELIST") if environ.get(n)), None)
    nodes: tuple[str, ...] = ()
    if nodelist_name is not None:
        nodes = tuple(expand_hostlist(environ[nodelist_name], source=nodelist_name))
    num_nodes = _int_var(environ, "SLURM_JOB_NUM_NODES", minimum=1)
    if num_nodes is None:
        num_nodes = _int_var(environ, "SLURM_NNODES", minimum=1)
    if nodes and num_nodes is not None and num_nodes != len(nodes):
        raise LaunchError(
            f"{nodelist_name} names {len(nodes)} node(s) but SLURM_JOB_NUM_NODES/SLURM_NNODES says "
            f"{num_nodes}; the Slurm environment is inconsistent (a variable copied from another job?)."
        )
    tasks: tuple[int, ...] | None = None
    if environ.get("SLURM_TASKS_PER_NODE"):
        tasks = tuple(expand_counts(environ["SLURM_TASKS_PER_NODE"], source="SLURM_TASKS_PER_NODE"))
        # Inside a step the counts are the step's nodes'; in an allocation, the job's.
    step_nodes: tuple[str, ...] = ()
    if environ.get("SLURM_STEP_NODELIST"):
        step_nodes = tuple(expand_hostlist(environ["SLURM_STEP_NODELIST"], source="SLURM_STEP_NODELIST"))
    step_id = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or None
    node_id = _int_var(environ, "SLURM_NODEID")
    env = SlurmEnv(
        job_id=job_id,
        step_id=step_id,
        nodes=nodes,
        num_nodes=num_nodes if num_nodes is not None else (len(nodes) or None),
        tasks_per_node=tasks,
        ntasks=_int_var(environ, "SLURM_NTASKS", minimum=1),
        node_id=node_id,
        proc_id=_int_var(environ, "SLURM_PROCID"),
        step_nodes=step_nodes,
        step_num_nodes=_int_var(environ, "SLURM_STEP_NUM_NODES", minimum=1),
    )
    if tasks is not None:
        expected = len(step_nodes) if env.in_step and step_nodes else len(nodes)
        if expected and len(tasks) != expected:
            raise LaunchError(
                f"SLURM_TASKS_PER_NODE={environ['SLURM_TASKS_PER_NODE']!r} gives counts for "
                f"{len(tasks)} node(s), but the {'step' if env.in_step and step_nodes else 'job'} has "
                f"{expected} node(s)."
            )
    if node_id is not None and env.in_step:
        total = env.step_num_nodes or len(step_nodes) or env.num_nodes
        if total is not None and node_id >= total:
            raise LaunchError(f"SLURM_NODEID={node_id} is not below the step's node count {total}.")
    return env
