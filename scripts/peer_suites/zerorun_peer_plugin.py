"""pytest plugin for running the peer DeepSpeed suites under zerorun's layer on CPU ranks
(``-p zerorun_peer_plugin``; scripts/peer_suites/run.py loads it). The suites' own files are
not touched: this plugin lifts the GPU-only gates that are meaningful on CPU (gates.py lists
every gate lifted and kept, with its reason) before the test modules import them, writes the
hub stand-ins (standins.py) into ``HF_HUB_CACHE``, and deselects the tests gates.py names.
With ``ZERORUN_PEER_LIFT=0`` (run.py --device cuda) it lifts nothing: the suites run as they are.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gates
import standins


def _identity(test_case: Any) -> Any:
    return test_case


def _lift() -> None:
    import accelerate.test_utils as acc_pkg
    import accelerate.test_utils.testing as acc
    import transformers.testing_utils as tf

    for module, names in ((tf, gates.LIFTED["transformers"]), (acc, gates.LIFTED["accelerate"])):
        for name in names:
            setattr(module, name, _identity)
            if module is acc and hasattr(acc_pkg, name):
                setattr(acc_pkg, name, _identity)


def _answer_probes() -> None:
    import importlib

    for path, (value, _reason) in gates.PROBES.items():
        module_name, name = path.rsplit(".", 1)
        answer = value == "True"
        setattr(importlib.import_module(module_name), name, lambda *a, _v=answer, **k: _v)


def pytest_configure(config: Any) -> None:
    cache = os.environ.get("HF_HUB_CACHE")
    if cache:
        standins.write_standins(Path(cache))
    if os.environ.get(gates.LIFT_ENV, "1") != "0":
        _lift()
        _answer_probes()


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    keep, dropped = [], []
    for item in items:
        reason = gates.deselected_reason(item.nodeid)
        (dropped if reason else keep).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
