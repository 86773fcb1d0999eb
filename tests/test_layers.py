"""ARCHITECTURE.md's layers, checked on the imports of every module (function-level imports too).

One table, lowest layer first. A module may import the packages of the layers below its own, never
one above it, and never a sibling of its own layer: the engine (parallel) and the checkpoints do not
know each other, nor do the CLI and the demo. A failure names the file that imports upwards.
"""

from __future__ import annotations

import ast
from pathlib import Path

import multigpu

ROOT = Path(multigpu.__file__).parent

LAYERS = [
    ("errors",),
    ("core", "_keys"),
    ("devices",),
    ("runtime",),
    ("profiling",),
    ("parallel", "checkpoint"),
    ("strategies",),
    ("report",),
    ("planning",),
    ("session",),
    ("launcher",),
    ("demo",),
    ("cli",),
    ("__main__",),  # python -m multigpu: the CLI
]
LAYER = {name: level for level, names in enumerate(LAYERS) for name in names}


def _unit(path: Path) -> str:
    """The package (``parallel``) or top-level module (``errors``) a file belongs to."""
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
        found |= {n.split(".")[1] for n in names if n.startswith("multigpu.") and n.count(".") >= 1}
        if isinstance(node, ast.ImportFrom) and node.module == "multigpu":  # from multigpu import x
            found |= {a.name for a in node.names if a.name in LAYER}
    return found


def _graph() -> dict[str, dict[str, list[str]]]:
    """unit -> imported unit -> the files that import it."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        unit = _unit(path)
        if unit == "__init__":  # the package's facade re-exports every layer
            continue
        for target in _imports(path) - {unit}:
            graph.setdefault(unit, {}).setdefault(target, []).append(str(path.relative_to(ROOT)))
    return graph


def test_every_unit_has_a_layer() -> None:
    units = {_unit(p) for p in ROOT.rglob("*.py")} - {"__init__"}
    assert units - set(LAYER) == set(), "add the new package to LAYERS and to ARCHITECTURE.md"


def test_no_unit_imports_one_above_it_or_beside_it() -> None:
    wrong = [
        f"{files[0]} imports multigpu.{target} (layer {LAYER[target]}: {'beside' if LAYER[target] == LAYER[unit] else 'above'} {unit}'s {LAYER[unit]})"
        for unit, targets in _graph().items()
        for target, files in targets.items()
        if LAYER[target] >= LAYER[unit]
    ]
    assert wrong == []


def test_no_two_units_depend_on_each_other() -> None:
    graph = {unit: set(targets) for unit, targets in _graph().items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            unit = todo.pop()
            if unit == goal:
                return True
            if unit not in seen:
                seen.add(unit)
                todo += graph.get(unit, ())
        return False

    cycles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if reaches(b, a)})
    assert cycles == []


def test_the_check_sees_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    """The checks above can fail: the parser finds both kinds of import in real source text."""
    source = tmp_path / "m.py"
    source.write_text("from multigpu.session import Session\n\ndef f():\n    import multigpu.cli.main\n")
    assert _imports(source) == {"session", "cli"}
