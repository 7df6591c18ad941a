"""launch/agent.py: the node agent's preflight answer (addresses, master port, the script)."""

from __future__ import annotations

import socket

import pytest

from zerorun.launch.agent import hello


def test_hello_reports_addresses_and_checks_the_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSH_CONNECTION", "10.0.0.1 50000 10.0.0.7 22")
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        info = hello({"check_port": port})
        assert info["client_addr"] == "10.0.0.1" and info["server_addr"] == "10.0.0.7"
        assert info["error"] and f"master port {port} is already in use" in info["error"]
    assert hello({"check_port": port})["error"] is None
    picked = hello({"pick_port": True})
    assert picked["error"] is None and 0 < picked["port"] < 65536
    assert hello({})["port"] is None
    missing = hello({"script": "no/such/train.py", "check_port": 1})
    assert "the script no/such/train.py does not exist there" in missing["error"]
    assert hello({"script": __file__})["error"] is None
