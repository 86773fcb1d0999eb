"""Defaults and doors that exist once in src/: each test reads every module's syntax tree and names the file
where a second copy appears.

- The default rendezvous port is :data:`multigpu.runtime.scheduler_world.DEFAULT_PORT`, a number nowhere else.
- Every collective multigpu issues passes ``runtime.collectives.issuing`` (ARCHITECTURE.md, 'Which rank never
  arrived'), but for the ones the map excepts: the pre-emption flag's, the ``--debug`` check's own, and the
  ones probes time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import multigpu
from multigpu.runtime.scheduler_world import DEFAULT_PORT

SRC = Path(multigpu.__file__).parent

_COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
}
# the exceptions ARCHITECTURE.md names: the pre-emption flag, --debug's own check, the probes that time
# collectives, a background checkpoint write's (on a group of its own, beside the training loop's ledger)
_OUTSIDE_THE_DOOR = {
    "runtime/preemption.py",
    "runtime/tracking.py",
    "planning/calibrate.py",
    "planning/_machine_probe_worker.py",
    "profiling/_allreduce_worker.py",
    "checkpoint/ranks.py",  # its _door is issuing on the training thread, and not on a background write's group
}


def _modules() -> list[tuple[str, ast.Module]]:
    return [(str(path.relative_to(SRC)), ast.parse(path.read_text())) for path in sorted(SRC.rglob("*.py"))]


def test_the_default_port_is_a_number_in_one_module() -> None:
    found = [
        f"{name}:{node.lineno}"
        for name, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in (DEFAULT_PORT, str(DEFAULT_PORT))
    ]
    assert len(found) == 1 and found[0].startswith("runtime/scheduler_world.py:"), (
        f"use multigpu.runtime.scheduler_world.DEFAULT_PORT instead of {DEFAULT_PORT} at {found}"
    )


def _collective_calls(tree: ast.AST, inside: bool = False) -> list[tuple[int, bool]]:
    """(line, inside a ``with issuing(...)`` block) of every ``dist.<collective>(...)`` call under ``tree``."""
    found: list[tuple[int, bool]] = []
    for child in ast.iter_child_nodes(tree):
        entered = inside
        if isinstance(child, ast.With):
            entered = inside or any(
                isinstance(item.context_expr, ast.Call)
                and getattr(item.context_expr.func, "id", getattr(item.context_expr.func, "attr", "")) == "issuing"
                for item in child.items
            )
        if (
            isinstance(child, ast.Call)
            and isinstance(child.func, ast.Attribute)
            and isinstance(child.func.value, ast.Name)
            and child.func.value.id == "dist"
            and child.func.attr in _COLLECTIVES
        ):
            found.append((child.lineno, inside))
        found += _collective_calls(child, entered)
    return found


def test_every_collective_passes_the_one_door() -> None:
    outside = [
        f"{name}:{line}"
        for name, tree in _modules()
        if name not in _OUTSIDE_THE_DOOR and name != "runtime/collectives.py"
        for line, inside in _collective_calls(tree)
        if not inside
    ]
    assert outside == [], f"issue these collectives inside runtime.collectives.issuing(...): {outside}"


def test_the_door_check_sees_a_collective_outside_it() -> None:
    """The check above can fail: a call outside the block is found, one inside is not."""
    tree = ast.parse(
        "with issuing('x'):\n    dist.all_reduce(t)\ndist.all_gather_object(a, b)\nwith other():\n    dist.barrier()\n"
    )
    assert _collective_calls(tree) == [(2, True), (3, False), (5, False)]
