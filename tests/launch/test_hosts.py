"""Hostfile grammar and --include/--exclude selectors (pure functions)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerorun.errors import HostfileError
from zerorun.launch.hosts import (
    Host,
    is_valid_hostname,
    local_hosts,
    parse_hostfile,
    parse_hostfile_text,
    parse_selector,
    select_hosts,
)

HOSTFILE = """\
# two nodes
worker-1 slots=4   # trailing comment

worker-2   slots=2 GLOO_SOCKET_IFNAME=eth1 NCCL_SOCKET_IFNAME=eth1
10.0.0.3 slots=8
"""


def pool() -> list[Host]:
    return parse_hostfile_text(HOSTFILE, source="hf")


def test_hostfile_order_slots_env_and_origin() -> None:
    hosts = pool()
    assert [h.name for h in hosts] == ["worker-1", "worker-2", "10.0.0.3"]
    assert [h.slots for h in hosts] == [(0, 1, 2, 3), (0, 1), tuple(range(8))]
    assert hosts[0].env == {}
    assert hosts[1].env == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}
    assert hosts[1].origin == "hf:4"


def test_hostfile_env_value_is_verbatim() -> None:
    (h,) = parse_hostfile_text("a slots=1 X=a=b;$(id)\n")
    assert h.env == {"X": "a=b;$(id)"}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("worker-1\n", "host 'worker-1' has no `slots=N`"),
        ("worker-1 4\n", "has no `slots=N`"),
        ("worker-1 slots=four\n", "slots='four' for host 'worker-1' is not a whole number"),
        ("worker-1 slots=\n", "is not a whole number"),
        ("worker-1 slots=-2\n", "slots=-2 for host 'worker-1' is negative"),
        ("worker-1 slots=0\n", "has slots=0"),
        ("a slots=1\n\n# x\na slots=2\n", "host 'a' is listed twice (first on line 1)"),
        ("", "lists no hosts"),
        ("# only comments\n\n   \n", "lists no hosts"),
        ("-oProxyCommand=x slots=1\n", "is not a host name"),
        ("a;touch${IFS}x slots=1\n", "is not a host name"),
        ("$(reboot) slots=1\n", "is not a host name"),
        ("user@host slots=1\n", "is not a host name"),
        ("a slots=1 oops\n", "unexpected 'oops' after the slots"),
        ("a slots=1 1X=2\n", "unexpected '1X=2'"),
        ("a slots=1 slots=2\n", "gives slots= twice"),
        ("a slots=1 MASTER_ADDR=x\n", "MASTER_ADDR is set by the launcher"),
        ("a slots=1 ZERORUN_RUN_ID=x\n", "ZERORUN_RUN_ID is set by the launcher"),
    ],
)
def test_malformed_hostfiles(text: str, fragment: str) -> None:
    with pytest.raises(HostfileError) as err:
        parse_hostfile_text(text, source="hf")
    assert fragment in str(err.value)
    if "lists no hosts" not in fragment:  # a bad line: the table names it (file:line, host)
        assert str(err.value).splitlines()[2].startswith(f"  hf:{text.count(chr(10))} ")


def test_every_bad_line_is_reported_in_one_table() -> None:
    """Not only the first: each bad line is a row of the failure table the preflight uses
    (launch/fanout.py: the line and its host, the problem, what is wrong, the fix)."""
    text = "a slots=1\nb slots=two\n\na slots=2\nc slots=1 RANK=3\nd slots=4\n"
    with pytest.raises(HostfileError) as err:
        parse_hostfile_text(text, source="hf")
    lines = str(err.value).splitlines()
    assert lines[0] == "hostfile hf failed on 3 lines: 1 environment, 1 listed twice, 1 slots"
    assert lines[1].split() == ["line", "problem", "what", "fix"]
    cuts = [lines[1].index(c) for c in ("problem", "what", "fix")]
    rows = [tuple(line[a:b].strip() for a, b in zip([0, *cuts], [*cuts, None], strict=True)) for line in lines[2:5]]
    assert rows == [  # by problem
        ("hf:5 c", "environment", "RANK is set by the launcher for each node or rank and cannot be given for host 'c'",
         "Remove it from the hostfile."),
        ("hf:4 a", "listed twice", "host 'a' is listed twice (first on line 1)",
         "List each node once, with all its slots: `HOST slots=N`."),
        ("hf:2 b", "slots", "slots='two' for host 'b' is not a whole number", "Write e.g. `b slots=8`."),
    ]
    assert lines[5] == "Nothing was started."


def test_windows_editors_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_bytes("\ufeffworker-1 slots=2\r\n# c\r\n\tworker-2\tslots=1\r\n".encode())
    assert [(h.name, h.slots) for h in parse_hostfile(path)] == [("worker-1", (0, 1)), ("worker-2", (0,))]


def test_ipv6_and_user_at_host_get_a_hint() -> None:
    for text in ("fe80::1 slots=1\n", "alice@node slots=1\n"):
        with pytest.raises(HostfileError, match="use an alias from ~/.ssh/config"):
            parse_hostfile_text(text)


def test_missing_hostfile_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(HostfileError, match="does not exist"):
        parse_hostfile(tmp_path / "nope")
    with pytest.raises(HostfileError, match="not a file"):
        parse_hostfile(tmp_path)


def test_hostfile_from_disk_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("a slots=1\nb slots=x\n")
    with pytest.raises(HostfileError, match=f"{path}:2"):
        parse_hostfile(path)
    path.write_bytes(b"\xff\xfe slots=1\n")
    with pytest.raises(HostfileError, match="cannot read hostfile"):
        parse_hostfile(path)


def test_shipped_example_hostfiles_parse() -> None:
    examples = sorted((Path(__file__).parents[2] / "hostfiles").glob("*"))
    examples = [p for p in examples if p.is_file() and p.suffix != ".md"]
    assert examples, "hostfiles/ has examples"
    for p in examples:
        assert parse_hostfile(p)


def test_selector_grammar() -> None:
    assert parse_selector("worker-1:0,1@worker-2") == {"worker-1": (0, 1), "worker-2": None}
    assert parse_selector(" worker-1 : 0 - 3 , 6 @ worker-2 ") == {"worker-1": (0, 1, 2, 3, 6), "worker-2": None}
    assert parse_selector("localhost:2,0") == {"localhost": (0, 2)}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "is empty"),
        ("a@@b", "stray '@'"),
        ("a:", "no slots after 'a:'"),
        ("a:x", "'x' is not a slot index"),
        ("a:3-1", "not a valid slot range"),
        ("a:1,1", "more than once"),
        ("a:0@a:1", "names host 'a' twice"),
        ("a b:0;rm", "is not a host name"),
    ],
)
def test_bad_selectors(text: str, fragment: str) -> None:
    with pytest.raises(HostfileError) as err:
        parse_selector(text)
    assert fragment in str(err.value)


def test_include_bare_host_means_all_slots_and_order_follows_pool() -> None:
    hosts = select_hosts(pool(), include="10.0.0.3:1,3 @ worker-1")
    assert [(h.name, h.slots) for h in hosts] == [("worker-1", (0, 1, 2, 3)), ("10.0.0.3", (1, 3))]


def test_exclude_slots_and_whole_hosts() -> None:
    hosts = select_hosts(pool(), exclude="worker-1:0,2@10.0.0.3")
    assert [(h.name, h.slots) for h in hosts] == [("worker-1", (1, 3)), ("worker-2", (0, 1))]
    # Excluding every slot of a host drops the host.
    hosts = select_hosts(pool(), exclude="worker-2:0-1")
    assert [h.name for h in hosts] == ["worker-1", "10.0.0.3"]


def test_selection_keeps_host_env() -> None:
    (h,) = select_hosts(pool(), include="worker-2:1")
    assert h.slots == (1,) and h.env["GLOO_SOCKET_IFNAME"] == "eth1"


def test_num_nodes_and_num_gpus_limit() -> None:
    hosts = select_hosts(pool(), num_nodes=2, num_gpus=2)
    assert [(h.name, h.slots) for h in hosts] == [("worker-1", (0, 1)), ("worker-2", (0, 1))]
    hosts = select_hosts(pool(), exclude="worker-1:0", num_gpus=2)
    assert hosts[0].slots == (1, 2)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"include": "a", "exclude": "b"}, "cannot be used together"),
        ({"include": "nohost:0"}, "names host 'nohost', which is not in the hostfile"),
        ({"exclude": "nohost"}, "which is not in the hostfile"),
        ({"include": "worker-2:2-3"}, "slot(s) 2, 3 of host 'worker-2' do not exist; it has slots 0-1"),
        ({"num_nodes": 4}, "--num_nodes 4 but only 3 node(s)"),
        ({"num_nodes": 0}, "at least 1"),
        ({"num_gpus": 4}, "worker-2 has 2"),
        ({"num_gpus": 0}, "at least 1"),
        ({"exclude": "worker-1@worker-2@10.0.0.3"}, "leaves no host"),
    ],
)
def test_bad_selection(kwargs: dict, fragment: str) -> None:
    with pytest.raises(HostfileError) as err:
        select_hosts(pool(), **kwargs)
    assert fragment in str(err.value)


def test_local_pool_for_one_node_selectors() -> None:
    (h,) = select_hosts(local_hosts(4), include="localhost:0,2")
    assert h.slots == (0, 2) and h.is_local
    (h,) = select_hosts(local_hosts(4), exclude="localhost:1")
    assert h.slots == (0, 2, 3)
    with pytest.raises(HostfileError, match="slot"):
        select_hosts(local_hosts(2), include="localhost:0,2")


def test_hostname_rules() -> None:
    for ok in ("a", "node-01", "gpu_3.cluster.local", "10.1.2.3", "A1"):
        assert is_valid_hostname(ok)
    for bad in ("-x", "a b", "a;b", "a|b", "a`b`", "a$b", "a'b", "", "a.", "h@x", "h:1"):
        assert not is_valid_hostname(bad)
