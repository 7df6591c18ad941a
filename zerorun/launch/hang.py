"""Hang analysis (pure): where each rank stands, from the stack dumps the shim's faulthandler
writes on SIGUSR1, and which ranks are behind. The supervisor decides *when* (--hang_timeout);
this module only reads the dumps it collected.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Sequence

from zerorun.launch.result import RankState, where

__all__ = ["innermost_user_frame", "hang_report"]

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")


def innermost_user_frame(dump: Sequence[str]) -> str | None:
    """From a faulthandler dump (most recent call first), the main thread's innermost frame
    outside zerorun and the standard library, as `file:line in func`."""
    blocks: list[list[tuple[str, str, str]]] = []
    for line in dump:
        if _THREAD.match(line.strip()):
            blocks.append([])
        m = _FRAME.match(line)
        if m and blocks:
            blocks[-1].append((m["file"], m["line"], m["func"]))
    if not blocks:
        return None
    # The main thread is the last block faulthandler prints (threads come newest first).
    frames = blocks[-1]
    for file, line, func in frames:
        if "/zerorun/shim.py" in file or "/threading.py" in file or "/runpy.py" in file:
            continue
        return f"{os.path.basename(file)}:{line} in {func}"
    return None


def hang_report(states: Sequence[RankState]) -> list[str]:
    """Where each rank is, and which are behind (lowest reported step, or alone at a place
    where the others are not)."""
    lines: list[str] = []
    places: dict[int, str] = {}
    for s in states:
        if s.returncode is not None:
            continue
        places[s.rank] = innermost_user_frame(s.stack_dump) or "no stack dump received"
        step = f" (last step {s.status['step']})" if s.status and "step" in s.status else ""
        lines.append(f"rank {where(s.spec)}: {places[s.rank]}{step}")
    steps = {s.rank: s.status["step"] for s in states if s.status and isinstance(s.status.get("step"), int)}
    behind: list[int] = []
    if steps and len(set(steps.values())) > 1:
        low = min(steps.values())
        behind = sorted(r for r, st in steps.items() if st == low)
    elif len(set(places.values())) > 1:
        counts = Counter(places.values()).most_common()
        if counts[0][1] > counts[1][1]:
            # The odd ones out: usually the ranks that never reached the collective the
            # others wait in.
            behind = sorted(r for r, p in places.items() if p != counts[0][0])
        else:
            lines.append("the ranks stopped at different places (no majority to compare with)")
    if behind:
        lines.append("behind: rank(s) " + ", ".join(map(str, behind)))
    return lines
