"""Sizes as people write them: '5GB', '500MiB', '1000' -> bytes.

Stdlib only, importable from anywhere (the consolidate command, the DeepSpeed layer's
`zero_to_fp32` in a rank) without loading a CLI framework or torch.
"""

from __future__ import annotations

import re

from zerorun.errors import CheckpointError

__all__ = ["parse_size"]

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes, '500MiB' -> 500 * 2**20, '1000' -> 1000 (Hugging Face's convention:
    GB is decimal, GiB binary). A checkpoint shard size: CheckpointError when it is not one."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise CheckpointError(f"--max_shard_size {text!r}: expected a size such as 5GB, 500MB or 2GiB")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise CheckpointError(f"--max_shard_size {text!r} must be positive")
    return n
