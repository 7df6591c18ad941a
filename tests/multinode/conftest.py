"""The fake cluster, built once per session and torn down in a finalizer even when tests fail.

Set-up problems fail the tests, never skip them (see mn_fabric.py). Helpers to run the launcher
are in mn_helpers.py.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import mn_fabric as fabric  # noqa: E402


@pytest.fixture(scope="session")
def cluster() -> Iterator[fabric.Fabric]:
    fab = fabric.create(3)
    try:
        hostfile = fab.dir / "hostfile"
        hostfile.write_text(
            "# the fake cluster of this test run\n"
            + "".join(f"{n.alias} slots=2 GLOO_SOCKET_IFNAME={n.ifname}  # {n.addr}\n" for n in fab.nodes)
        )
        yield fab
    finally:
        fabric.destroy(fab)

