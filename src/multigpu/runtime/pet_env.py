"""torchrun's ``PET_*`` variables (what Kubeflow's PyTorchJob sets on each pod), read for ``multigpu launch``.

torchrun takes each of its flags from ``PET_<FLAG>`` when the command line leaves it out; a PyTorchJob
sets ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_NPROC_PER_NODE`` and, with newer operators, the master's
``PET_MASTER_ADDR``/``PET_MASTER_PORT`` (older ones: ``MASTER_ADDR``/``MASTER_PORT``).
:func:`pet_launcher` turns them into ``multigpu launch``'s defaults, by long flag name, and refuses a
value that does not parse, or a node rank outside the nodes, by its name, before any process waits for a
world that cannot form. :mod:`multigpu.runtime.schedulers` asks it first.

Example:
    >>> pet_launcher({"PET_NNODES": "2", "PET_NODE_RANK": "1"})
    {'nnodes': '2', 'node-rank': '1'}
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from multigpu.errors import LaunchError
from multigpu.runtime.scheduler_world import parse_count, read_addr, read_port, shown

# torchrun's own variables (its arguments' env fallbacks), by multigpu launch's long flag name
PET_FLAGS = {
    "nnodes": "PET_NNODES",
    "node-rank": "PET_NODE_RANK",
    "nproc-per-node": "PET_NPROC_PER_NODE",
    "master-addr": "PET_MASTER_ADDR",
    "master-port": "PET_MASTER_PORT",
    "rdzv-backend": "PET_RDZV_BACKEND",
    "rdzv-endpoint": "PET_RDZV_ENDPOINT",
    "rdzv-id": "PET_RDZV_ID",
    "rdzv-conf": "PET_RDZV_CONF",
    "max-restarts": "PET_MAX_RESTARTS",
}
# torchrun's words for --nproc-per-node, as multigpu launch reads them: one per GPU, or one per core
_NPROC_WORDS = {"auto": lambda: "auto", "gpu": lambda: "auto", "cpu": lambda: str(os.cpu_count() or 1)}
_FIX = "fix the PyTorchJob's spec (or unset the variable set by hand)"


def pet_launcher(env: Mapping[str, str]) -> dict[str, str]:
    """``multigpu launch``'s defaults from ``PET_*`` (empty when none is set), by long flag name.

    Raises:
        LaunchError: naming the variable, its value and the fix: ``PET_NNODES`` not a count or
            ``MIN:MAX`` of counts >= 1, ``PET_NODE_RANK`` not below the nodes, ``PET_NPROC_PER_NODE``
            not ``auto``/``gpu``/``cpu`` or a count >= 1, a master address or port that is not one, a
            rendezvous value with spaces or non-ASCII characters.
    """
    pet = {flag: env[name] for flag, name in PET_FLAGS.items() if env.get(name)}
    if not pet:
        return {}
    for flag in ("rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf"):
        if flag in pet and re.fullmatch(r"[!-~]+", pet[flag]) is None:
            raise LaunchError(f"{shown(PET_FLAGS[flag], pet[flag])} holds spaces or non-ASCII characters; {_FIX}")
    most_nodes = _nodes(pet["nnodes"]) if "nnodes" in pet else None
    if "node-rank" in pet:
        rank = parse_count("PET_NODE_RANK", pet["node-rank"], _FIX)
        if most_nodes is not None and rank >= most_nodes:
            raise LaunchError(
                f"PET_NODE_RANK={rank} lies outside PET_NNODES={pet['nnodes']!r} nodes (node ranks are "
                f"0..{most_nodes - 1}); {_FIX}"
            )
    if "max-restarts" in pet:
        parse_count("PET_MAX_RESTARTS", pet["max-restarts"], _FIX)
    if "nproc-per-node" in pet:
        pet["nproc-per-node"] = _nproc(pet["nproc-per-node"])
    # a PyTorchJob also sets MASTER_ADDR/MASTER_PORT (older operators set no PET_MASTER_*): rank 0's pod
    for flag, name in (("master-addr", "PET_MASTER_ADDR"), ("master-port", "PET_MASTER_PORT")):
        if flag not in pet and env.get(name[4:]):
            name = name[4:]
        if env.get(name):
            pet[flag] = str(read_port(env, name)) if flag == "master-port" else str(read_addr(env, name))
    return pet


def _nodes(value: str) -> int:
    """The most nodes ``PET_NNODES`` allows: ``2``, or ``1:4`` (elastic: 1 to 4)."""
    low, colon, high = value.partition(":")
    fix = f"PET_NNODES is a count of nodes >= 1 or MIN:MAX (e.g. 2 or 1:4); {_FIX}"
    if re.fullmatch(r"[0-9]+(:[0-9]+)?", value) is None:  # the whole value named, not the part after a colon
        raise LaunchError(f"{shown('PET_NNODES', value)} is not a count of nodes or MIN:MAX; {fix}")
    least = parse_count("PET_NNODES", low, fix)
    most = parse_count("PET_NNODES", high, fix) if colon else least
    if not 1 <= least <= most:
        raise LaunchError(f"{shown('PET_NNODES', value)} asks for no node or a range that runs backwards; {fix}")
    return most


def _nproc(value: str) -> str:
    if value in _NPROC_WORDS:  # a PyTorchJob's nprocPerNode: auto, gpu, cpu or a count
        return _NPROC_WORDS[value]()
    fix = f"PET_NPROC_PER_NODE is auto, gpu, cpu or a count of processes >= 1; {_FIX}"
    if parse_count("PET_NPROC_PER_NODE", value, fix) == 0:
        raise LaunchError(f"PET_NPROC_PER_NODE={value!r} starts no process; {fix}")
    return value
