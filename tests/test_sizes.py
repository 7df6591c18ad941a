"""zerorun/sizes.py: sizes as people write them."""

from __future__ import annotations

import pytest

from zerorun.errors import CheckpointError
from zerorun.sizes import parse_size


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("500mb") == 500 * 10**6
    assert parse_size("1.5KB") == 1500
    assert parse_size("123") == 123
    with pytest.raises(CheckpointError):
        parse_size("0")
