"""SLURM's compressed lists (runtime/slurm_lists.py): the lazy count and i-th host against a straightforward
expansion written here (differential, on generated lists and on arbitrary text), huge lists answered without
expanding, and every malformed form refused by the variable's name, quickly."""

from __future__ import annotations

import itertools
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from multigpu.errors import LaunchError
from multigpu.runtime.scheduler_world import MAX_WORLD
from multigpu.runtime.slurm_lists import Hostlist, TasksPerNode, expand_hostlist, expand_tasks_per_node


def naive_hosts(text: str) -> list[str]:
    """Every host, by brute force: split at the top-level commas, expand each bracket group in full and
    take the product of the groups, the first varying slowest (the oracle; it trusts its input)."""
    names, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            names.append(current)
            current = ""
        else:
            current += char
    hosts: list[str] = []
    for name in [*names, current]:
        pieces = re.split(r"\[([^\]]*)\]", name)
        choices: list[list[str]] = []
        for index, piece in enumerate(pieces):
            if index % 2 == 0:
                choices.append([piece])
                continue
            numbers = []
            for item in piece.split(","):
                low, _, high = item.partition("-")
                numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high or low) + 1)]
            choices.append(numbers)
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


# -- generated lists in the grammar SLURM writes: several names, each with 0..2 bracket groups ----------

_literal = st.text(alphabet="abcxyz-.", min_size=1, max_size=4)
_item = st.tuples(st.integers(0, 120), st.integers(0, 4), st.integers(1, 3)).map(
    lambda t: str(t[0]).zfill(t[2]) if t[1] == 0 else f"{str(t[0]).zfill(t[2])}-{str(t[0] + t[1]).zfill(t[2])}"
)
_group = st.lists(_item, min_size=1, max_size=3).map(lambda items: "[" + ",".join(items) + "]")
_name = st.tuples(_literal, st.lists(st.tuples(_group, st.text(alphabet="nrx", max_size=2)), max_size=2)).map(
    lambda t: t[0] + "".join(group + tail for group, tail in t[1])
)
_hostlist = st.lists(_name, min_size=1, max_size=4).map(",".join)


@given(_hostlist)
def test_the_count_and_every_host_agree_with_a_full_expansion(text: str) -> None:
    expected = naive_hosts(text)
    hosts = Hostlist(text)
    assert len(hosts) == len(expected)
    assert [hosts.host(i) for i in range(len(hosts))] == expected
    assert expand_hostlist(text) == expected


@settings(max_examples=300)
@given(st.text(alphabet="ab01239[],-x", min_size=0, max_size=14))
def test_any_text_is_read_as_the_expansion_says_or_refused_by_name(text: str) -> None:
    start = time.perf_counter()
    try:
        hosts = Hostlist(text, "SLURM_STEP_NODELIST")
    except LaunchError as exc:
        assert str(exc).startswith("SLURM_STEP_NODELIST=") and "SLURM writes it like" in str(exc)
    else:
        expected = naive_hosts(text)
        assert len(hosts) == len(expected) and [hosts.host(i) for i in range(len(hosts))] == expected
    assert time.perf_counter() - start < 1


def test_hostlist_forms_slurm_writes() -> None:
    assert expand_hostlist("node[01-03,07],gpu[1-2]") == ["node01", "node02", "node03", "node07", "gpu1", "gpu2"]
    assert expand_hostlist("n[08-10]") == ["n08", "n09", "n10"]
    assert expand_hostlist("single") == ["single"]
    assert expand_hostlist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    assert expand_hostlist("a,b[3]") == ["a", "b3"]


def test_a_huge_list_is_counted_and_indexed_without_expanding() -> None:
    start = time.perf_counter()
    hosts = Hostlist("node[1-100000000]")
    assert (len(hosts), hosts.host(0), hosts.host(99_999_999)) == (100_000_000, "node1", "node100000000")
    grid = Hostlist("r[0-999]n[0000-9999],login")  # groups multiply: 10 million, then one more
    assert (len(grid), grid.host(0), grid.host(10_001), grid.host(10_000_000)) == (
        10_000_001,
        "r0n0000",
        "r1n0001",
        "login",
    )
    tasks = TasksPerNode("4(x100000000),1")
    assert (tasks.nodes, tasks.total, tasks.on_node(99_999_999), tasks.on_node(100_000_000)) == (
        100_000_001,
        400_000_001,
        4,
        1,
    )
    assert time.perf_counter() - start < 1
    with pytest.raises(LaunchError, match=r"SLURM_JOB_NODELIST='node\[1-100000000\]' names 100000000 hosts, more than"):
        expand_hostlist("node[1-100000000]")  # the full list only up to a bound
    with pytest.raises(LaunchError, match=r"names 100000001 nodes, more than"):
        expand_tasks_per_node("4(x100000000),1")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node[1-3", "has an unclosed '\\['"),
        ("node[", "has an unclosed '\\['"),
        ("node]", "nested or unbalanced brackets"),
        ("node[3-1]", r"the range '3-1', which runs backwards \(write 1-3\)"),
        ("node[a-b]", r"'a-b' is not a number or a range like 01-03"),
        ("node[]", r"'' is not a number or a range"),
        ("node[1-]", r"'1-' is not a number"),
        ("node[-1]", r"'-1' is not a number"),
        ("n[[1]]", "nested"),
        ("n[1[2]]", "nested"),
        ("", "is empty or holds spaces or non-ASCII"),
        (" ", "is empty or holds spaces or non-ASCII"),
        ("node 1", "holds spaces"),
        ("nöde[1-2]", "non-ASCII"),
        ("node[١-٣]", "non-ASCII"),  # digits of another script: int() would take them
        ("a,,b", "an empty host name"),
        ("a,", "an empty host name"),
        ("node[" + "9" * 5000 + "]", "a host number of more than 18 digits"),
        ("node[1-" + "9" * 5000 + "]", "a host number of more than 18 digits"),
        ("node[0-999999999999999999]", f"names more than {MAX_WORLD} hosts"),
        ("a[0-99999]b[0-99999]", f"names more than {MAX_WORLD} hosts"),
        (",".join(["n[0-999999999]"] * 3), f"names more than {MAX_WORLD} hosts"),
    ],
)
def test_malformed_hostlists_are_refused_by_name_quickly(text: str, message: str) -> None:
    start = time.perf_counter()
    with pytest.raises(
        LaunchError, match=r"SLURM_STEP_NODELIST=.*" + message + r".*SLURM writes it like 'node\[01-03,07\]"
    ):
        Hostlist(text, "SLURM_STEP_NODELIST")
    assert time.perf_counter() - start < 1


def test_a_long_value_is_shown_cut_short() -> None:
    with pytest.raises(LaunchError) as caught:
        Hostlist("node[" + "9" * 5000 + "]")
    assert "(5006 characters)" in str(caught.value) and len(str(caught.value)) < 400


@given(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 5), st.booleans()), min_size=1, max_size=6))
def test_tasks_per_node_agree_with_a_full_expansion(groups: list[tuple[int, int, bool]]) -> None:
    text = ",".join(f"{tasks}(x{repeat})" if repeat > 1 or spelled else str(tasks) for tasks, repeat, spelled in groups)
    expected = [tasks for tasks, repeat, _ in groups for _ in range(repeat)]
    counts = TasksPerNode(text)
    assert (counts.nodes, counts.total) == (len(expected), sum(expected))
    assert [counts.on_node(node) for node in range(counts.nodes)] == expected == expand_tasks_per_node(text)


def test_tasks_per_node() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    counts = TasksPerNode("2(x3),1")
    assert (counts.nodes, counts.total, [counts.on_node(n) for n in range(4)]) == (4, 7, [2, 2, 2, 1])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("two", r"SLURM_TASKS_PER_NODE='two' is not SLURM's form"),
        ("", r"SLURM_TASKS_PER_NODE='' is not SLURM's form"),
        (" 2", r"is not SLURM's form"),
        ("2(x3", r"is not SLURM's form"),
        ("2,,1", r"is not SLURM's form"),
        ("-2", r"is not SLURM's form"),
        ("²", r"is not SLURM's form"),
        ("0,2", r"a node without tasks \('0'\)"),
        ("2(x0)", r"a node without tasks"),
        (
            "1(x99999999999999999999)",
            r"SLURM_TASKS_PER_NODE='1\(x99999999999999999999\)' holds .*a count above 2147483647",
        ),
        ("9" * 5000, r"\(5000 characters\) holds .*a count above 2147483647"),
        ("1000000(x10000)", r"adds up to more than 2147483647 tasks"),
    ],
)
def test_malformed_tasks_per_node_are_refused_by_name_quickly(value: str, message: str) -> None:
    start = time.perf_counter()
    with pytest.raises(LaunchError, match=message + r".*SLURM writes SLURM_TASKS_PER_NODE like '2\(x3\),1'"):
        TasksPerNode(value)
    assert time.perf_counter() - start < 1
