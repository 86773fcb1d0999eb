"""SLURM's compressed lists: hostlists (``node[01-03,07]``) and tasks per node (``2(x3),1``), read lazily.

SLURM writes a step's or a job's hosts and task counts in a compressed form
(``SLURM_STEP_NODELIST``, ``SLURM_JOB_NODELIST``, ``SLURM_STEP_TASKS_PER_NODE``,
``SLURM_TASKS_PER_NODE``); :mod:`multigpu.runtime.schedulers` asks here how many entries a list has
and what its i-th is. Neither is expanded to answer: ``node[1-100000000]`` has 100000000 hosts, the
first ``node1``, found in the time the text takes to read. A list of more than
:data:`~multigpu.runtime.scheduler_world.MAX_WORLD` entries, a number of more digits than SLURM writes
and every form SLURM does not write are refused by the variable's name; :func:`expand_hostlist` and
:func:`expand_tasks_per_node`, which do build the whole list, refuse one longer than ``limit``.

Example:
    >>> hosts = Hostlist("node[01-03,07],gpu[1-2]")
    >>> len(hosts), hosts.host(0), hosts.host(5)
    (6, 'node01', 'gpu2')
    >>> expand_tasks_per_node("2(x3),1", name="SLURM_TASKS_PER_NODE")
    [2, 2, 2, 1]
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NoReturn

from multigpu.errors import LaunchError
from multigpu.runtime.scheduler_world import MAX_WORLD, parse_count, shown

MAX_EXPANDED = 1 << 16  # entries expand_hostlist / expand_tasks_per_node list by default
_MAX_HOST_DIGITS = 18  # SLURM keeps a host number in an unsigned long
_HOSTLIST_FORM = "SLURM writes it like 'node[01-03,07],gpu5'; was it set by hand?"


@dataclass(frozen=True)
class _Range:
    low: int
    size: int
    width: int  # SLURM pads every number of a range to its first bound's width


@dataclass(frozen=True)
class _Axis:
    """One bracket group: ``[01-03,07]``."""

    ranges: tuple[_Range, ...]
    size: int

    def item(self, index: int) -> str:
        for part in self.ranges:
            if index < part.size:
                return str(part.low + index).zfill(part.width)
            index -= part.size
        raise IndexError(index)  # unreachable: callers index below size


@dataclass(frozen=True)
class _Name:
    """One top-level name: text and bracket groups in turn (``r[1-2]n[1-2]``: the first group varies slowest)."""

    parts: tuple[str | _Axis, ...]
    size: int

    def host(self, index: int) -> str:
        out = []
        stride = self.size
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
            else:
                stride //= part.size
                out.append(part.item(index // stride % part.size))
        return "".join(out)


class Hostlist:
    """A SLURM hostlist, read once: its length and its i-th host, without listing the others.

    Args:
        value: the variable's value, e.g. ``"node[01-03,07],gpu[1-2]"``.
        name: the variable, for the messages.

    Raises:
        LaunchError: naming the variable, its value and the form SLURM writes: an empty list or an
            empty name, spaces or non-ASCII characters, unbalanced or nested brackets, an item that is
            not a number or a range, a range that runs backwards, a number of more than 18 digits, or
            more than :data:`~multigpu.runtime.scheduler_world.MAX_WORLD` hosts.
    """

    def __init__(self, value: str, name: str = "SLURM_JOB_NODELIST") -> None:
        self._value, self._variable = value, name
        if re.fullmatch(r"[!-~]+", value) is None:
            self._refuse("is empty or holds spaces or non-ASCII characters")
        self._names = tuple(self._parse_name(text) for text in self._split_top_level())
        self._size = 0
        for parsed in self._names:
            self._size += parsed.size
            if self._size > MAX_WORLD:
                self._refuse(f"names more than {MAX_WORLD} hosts, more than torch.distributed can count")

    def __len__(self) -> int:
        return self._size

    def host(self, index: int) -> str:
        """The ``index``-th host (0 is the first), as SLURM orders them."""
        if not 0 <= index < self._size:
            raise IndexError(f"host {index} of a hostlist of {self._size}")
        for parsed in self._names:
            if index < parsed.size:
                return parsed.host(index)
            index -= parsed.size
        raise IndexError(index)  # unreachable

    def _refuse(self, problem: str) -> NoReturn:
        raise LaunchError(f"{shown(self._variable, self._value)} {problem}; {_HOSTLIST_FORM}")

    def _split_top_level(self) -> list[str]:
        """The names between the commas outside brackets."""
        names, depth, start = [], 0, 0
        for at, char in enumerate(self._value):
            if char == "[":
                depth += 1
            elif char == "]":
                depth -= 1
            if depth not in (0, 1):
                self._refuse("has nested or unbalanced brackets")
            if char == "," and depth == 0:
                names.append(self._value[start:at])
                start = at + 1
        if depth:
            self._refuse("has an unclosed '['")
        names.append(self._value[start:])
        if "" in names:
            self._refuse("has an empty host name (two commas, or one at an end)")
        return names

    def _parse_name(self, text: str) -> _Name:
        pieces = re.split(r"\[([^\]]*)\]", text)  # text, group, text, group, ..., text
        parts: list[str | _Axis] = []
        size = 1
        for index, piece in enumerate(pieces):
            if index % 2 == 0:
                if piece:
                    parts.append(piece)
                continue
            axis = self._parse_group(piece)
            parts.append(axis)
            size *= axis.size
            if size > MAX_WORLD:
                self._refuse(f"names more than {MAX_WORLD} hosts, more than torch.distributed can count")
        return _Name(tuple(parts), size)

    def _parse_group(self, group: str) -> _Axis:
        ranges, size = [], 0
        for item in group.split(","):
            match = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", item)
            if match is None:
                self._refuse(f"holds [{group[:40]}]: {item[:40]!r} is not a number or a range like 01-03")
            low, high = match.group(1), match.group(2) or match.group(1)
            if max(len(low), len(high)) > _MAX_HOST_DIGITS:
                self._refuse(f"holds a host number of more than {_MAX_HOST_DIGITS} digits")
            if int(high) < int(low):
                self._refuse(f"holds the range {item!r}, which runs backwards (write {high}-{low})")
            ranges.append(_Range(int(low), int(high) - int(low) + 1, len(low)))
            size += ranges[-1].size
            if size > MAX_WORLD:
                self._refuse(f"names more than {MAX_WORLD} hosts, more than torch.distributed can count")
        return _Axis(tuple(ranges), size)


def expand_hostlist(hostlist: str, *, name: str = "SLURM_JOB_NODELIST", limit: int = MAX_EXPANDED) -> list[str]:
    """Every host of a SLURM hostlist, in order: ``"a[1-3,7],b"`` -> ``a1, a2, a3, a7, b``.

    Ranges keep their zero padding (``node[08-10]`` -> ``node08, node09, node10``), and several
    bracket groups in one name multiply (``r[1-2]n[1-2]`` -> ``r1n1, r1n2, r2n1, r2n2``). To ask for
    one host or the count, use :class:`Hostlist`, which lists nothing.

    Raises:
        LaunchError: a list :class:`Hostlist` refuses, or one of more than ``limit`` hosts.
    """
    hosts = Hostlist(hostlist, name)
    if len(hosts) > limit:
        raise LaunchError(
            f"{shown(name, hostlist)} names {len(hosts)} hosts, more than the {limit} this lists; ask "
            "multigpu.runtime.slurm_lists.Hostlist for the count or one host"
        )
    return [hosts.host(index) for index in range(len(hosts))]


class TasksPerNode:
    """SLURM's tasks per node (``SLURM_TASKS_PER_NODE``, ``SLURM_STEP_TASKS_PER_NODE``), read once:
    ``"2(x3),1"`` is 4 nodes, 7 tasks, 2 on node 0.

    Raises:
        LaunchError: naming the variable and its value: a form SLURM does not write (``'2(x3),1'``), a
            node without tasks, or more than :data:`~multigpu.runtime.scheduler_world.MAX_WORLD` tasks.
    """

    def __init__(self, value: str, name: str = "SLURM_TASKS_PER_NODE") -> None:
        self._groups: list[tuple[int, int]] = []  # (tasks on each node, nodes)
        self.nodes = self.total = 0
        fix = f"SLURM writes {name} like '2(x3),1' (2 tasks on each of 3 nodes, then 1); was it set by hand?"
        for item in value.split(","):
            match = re.fullmatch(r"([0-9]+)(?:\(x([0-9]+)\))?", item)
            if match is None:
                raise LaunchError(f"{shown(name, value)} is not SLURM's form; {fix}")
            try:
                tasks, repeat = (parse_count(name, match.group(i) or "1", fix) for i in (1, 2))
            except LaunchError:  # digits, but too many: show the whole value
                raise LaunchError(
                    f"{shown(name, value)} holds {item[:40]!r}, a count above {MAX_WORLD}, the most torch.distributed "
                    f"can count; {fix}"
                ) from None
            if tasks == 0 or repeat == 0:
                raise LaunchError(f"{shown(name, value)} has a node without tasks ({item!r}); {fix}")
            self._groups.append((tasks, repeat))
            self.nodes += repeat
            self.total += tasks * repeat
            if self.total > MAX_WORLD:
                raise LaunchError(
                    f"{shown(name, value)} adds up to more than {MAX_WORLD} tasks, more than torch.distributed "
                    f"can count; {fix}"
                )

    def on_node(self, node: int) -> int:
        """The tasks on node ``node`` (0 is the first)."""
        if not 0 <= node < self.nodes:
            raise IndexError(f"node {node} of {self.nodes}")
        for tasks, repeat in self._groups:
            if node < repeat:
                return tasks
            node -= repeat
        raise IndexError(node)  # unreachable


def expand_tasks_per_node(value: str, *, name: str = "SLURM_TASKS_PER_NODE", limit: int = MAX_EXPANDED) -> list[int]:
    """Tasks per node, one entry per node: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Raises:
        LaunchError: a value :class:`TasksPerNode` refuses, or one of more than ``limit`` nodes.
    """
    counts = TasksPerNode(value, name)
    if counts.nodes > limit:
        raise LaunchError(f"{shown(name, value)} names {counts.nodes} nodes, more than the {limit} this lists")
    return [counts.on_node(node) for node in range(counts.nodes)]
