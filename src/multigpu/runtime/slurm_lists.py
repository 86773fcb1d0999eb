"""SLURM's compressed lists: hostlists (``node[01-03,07]``) and tasks per node (``2(x3),1``), expanded.

SLURM writes a step's or a job's hosts and task counts in a compressed form
(``SLURM_STEP_NODELIST``, ``SLURM_JOB_NODELIST``, ``SLURM_STEP_TASKS_PER_NODE``,
``SLURM_TASKS_PER_NODE``); :mod:`multigpu.runtime.schedulers` asks here for one entry per node.

Example:
    >>> expand_hostlist("node[01-03,07],gpu[1-2]")
    ['node01', 'node02', 'node03', 'node07', 'gpu1', 'gpu2']
    >>> expand_tasks_per_node("2(x3),1", name="SLURM_TASKS_PER_NODE")
    [2, 2, 2, 1]
"""

from __future__ import annotations

import re

from multigpu.errors import LaunchError


def expand_hostlist(hostlist: str) -> list[str]:
    """Every host of a SLURM hostlist, in order: ``"a[1-3,7],b"`` -> ``a1, a2, a3, a7, b``.

    Ranges keep their zero padding (``node[08-10]`` -> ``node08, node09, node10``), and several
    bracket groups in one name multiply (``r[1-2]n[1-2]`` -> ``r1n1, r1n2, r2n1, r2n2``).

    Raises:
        LaunchError: unbalanced brackets or a range that runs backwards.
    """
    hosts: list[str] = []
    for name in _split_top_level(hostlist):
        hosts += _expand_name(name, hostlist)
    return hosts


def _split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise LaunchError(
                f"hostlist {text!r} has unbalanced or nested brackets; SLURM writes e.g. 'node[01-03,07]'"
            )
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise LaunchError(f"hostlist {text!r} has an unclosed '['; SLURM writes e.g. 'node[01-03,07]'")
    return [part.strip() for part in [*parts, current] if part.strip()]


def _expand_name(name: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    expanded: list[str] = []
    for item in match.group(1).split(","):
        low, _, high = item.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise LaunchError(f"hostlist {whole!r}: {item!r} is not a number or a range like 01-03")
        if high and int(high) < int(low):
            raise LaunchError(f"hostlist {whole!r}: the range {item!r} runs backwards; write it as {high}-{low}")
        width = len(low)  # SLURM pads every number of a range to its first bound's width
        for number in range(int(low), int(high or low) + 1):
            expanded += [head + str(number).zfill(width) + rest for rest in _expand_name(tail, whole)]
    return expanded


def expand_tasks_per_node(value: str, *, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Tasks per node (``SLURM_TASKS_PER_NODE``, ``SLURM_STEP_TASKS_PER_NODE``): ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Args:
        value: the variable's value.
        name: the variable, for the message.

    Raises:
        LaunchError: a value SLURM does not write.
    """
    counts: list[int] = []
    for item in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise LaunchError(f"{name}={value!r} is not SLURM's form (e.g. '2(x3),1')")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts
