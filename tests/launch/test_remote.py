"""launch/remote.py: the nodes' preflight answers checked, their GPUs against the plan."""

from __future__ import annotations

import pytest

from zerorun.errors import LaunchError
from zerorun.launch import wire
from zerorun.launch.hosts import parse_hostfile_text
from zerorun.launch.plan import DeviceInfo, LaunchOptions, Target, build_plan


def test_preflight_answers_are_checked() -> None:
    """Version mismatch, a node's own problem, an agent that died before answering."""
    import queue
    from types import SimpleNamespace

    from zerorun._version import __version__
    from zerorun.launch.remote import _collect_hellos

    def channel(*messages: object, stderr: tuple[str, ...] = (), code: int | None = 1) -> object:
        q: queue.Queue[object] = queue.Queue()
        for m in messages:
            q.put(m)
        return SimpleNamespace(
            messages=q, stderr_tail=list(stderr), exit_status=lambda timeout=2.0: code,
            target=SimpleNamespace(display="nodeX (10.0.0.9)"),
        )

    ok = {"t": "hello", "version": __version__, "protocol": wire.PROTOCOL_VERSION}
    channels = {
        "a": channel(ok),
        "b": channel({"t": "hello", "version": "0.9", "protocol": wire.PROTOCOL_VERSION}),
        "c": channel(ok | {"error": "master port 1 is already in use there", "error_kind": "port"}),
        "d": channel(None, stderr=("/usr/bin/python3: No module named zerorun",)),
        "e": channel(None, stderr=("bash: /opt/py/bin/python: No such file or directory",), code=127),
        "f": channel(),  # silent
    }
    hellos, errors = _collect_hellos(channels, "/opt/py/bin/python", "/work", timeout=0.2)  # type: ignore[arg-type]
    assert list(hellos) == ["a"]
    problems = {name: (f.category, f.message) for name, f in errors.items()}  # rows of fanout.failure_table
    assert problems["b"][0] == "version" and f"imports zerorun 0.9, this launcher is zerorun {__version__}" in problems["b"][1]
    assert problems["c"] == ("port", "master port 1 is already in use there")
    assert problems["d"][0] == "zerorun" and "cannot import zerorun" in problems["d"][1]
    assert problems["e"][0] == "python" and "the remote interpreter /opt/py/bin/python does not exist there" in problems["e"][1]
    assert problems["f"] == ("timeout", "the node agent did not answer within 0.2 s")


def test_device_check_against_the_nodes_gpus() -> None:
    from zerorun.launch.remote import check_devices

    hosts = parse_hostfile_text("n1 slots=2\nn2 slots=4\n")
    no_local_gpu = DeviceInfo(gpus=(), cores=2)
    cuda = build_plan(LaunchOptions(target=Target(script="t.py"), device="cuda"), hosts, no_local_gpu,
                      master_port=1, run_id="r")
    assert cuda.device == "cuda" and cuda.nodes[1].visible_devices == ("0", "1", "2", "3")
    check_devices(cuda, {"n1": {"gpus": 2}, "n2": {"gpus": 8}}, auto=False)
    with pytest.raises(LaunchError, match=r"n2 has 2 GPU\(s\), but the job uses its slot\(s\) 0, 1, 2, 3"):
        check_devices(cuda, {"n1": {"gpus": 2}, "n2": {"gpus": 2}}, auto=False)
    cpu = build_plan(LaunchOptions(target=Target(script="t.py")), hosts, no_local_gpu, master_port=1, run_id="r")
    assert cpu.device == "cpu"
    with pytest.raises(LaunchError, match="the nodes have GPUs \\(n2\\) but this machine has none"):
        check_devices(cpu, {"n1": {"gpus": 0}, "n2": {"gpus": 8}}, auto=True)
    check_devices(cpu, {"n1": {"gpus": 0}, "n2": {"gpus": 8}}, auto=False)  # --device cpu: as asked
    check_devices(cpu, {"n1": {"gpus": 0}, "n2": {"gpus": 0}}, auto=True)
    # A job with a local node still needs local GPUs for --device cuda.
    with pytest.raises(LaunchError, match="no GPU is visible"):
        build_plan(LaunchOptions(target=Target(script="t.py"), device="cuda"),
                   parse_hostfile_text("localhost slots=1\nn2 slots=1\n"), no_local_gpu, master_port=1, run_id="r")
