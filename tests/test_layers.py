"""ARCHITECTURE.md's layer table, checked on the imports of every module (function-level imports too).

The table is read from ARCHITECTURE.md itself, so the map and the check cannot drift apart. A module
may import the packages of the layers below its own, never one above it, and never a sibling on its
own line: the engine (parallel) and the checkpoints do not know each other. A failure names the file.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import multigpu

ROOT = Path(multigpu.__file__).parent
MAP = ROOT.parents[1] / "ARCHITECTURE.md"


def _layers() -> list[tuple[str, ...]]:
    """The packages of each layer, lowest first, from the first code block under ``## Layers``."""
    section = MAP.read_text().split("## Layers", 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert block is not None, "ARCHITECTURE.md's Layers section has no code block"
    lines = [line.split("  ")[0] for line in block.group(1).splitlines() if line[:1].strip()]  # not continuations
    return [tuple(name.strip() for name in line.split(",")) for line in reversed(lines)]


LAYERS = _layers()
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


def test_every_unit_has_a_layer_and_every_layer_exists() -> None:
    units = {_unit(p) for p in ROOT.rglob("*.py")} - {"__init__"}
    assert units - set(LAYER) == set(), "add the new package to ARCHITECTURE.md's layer table"
    assert set(LAYER) - units == set(), "ARCHITECTURE.md's layer table names packages src/multigpu/ does not have"


def test_every_file_the_map_names_exists() -> None:
    """``parallel/backward.py`` in ARCHITECTURE.md is a file of the package (or of the repository)."""
    named = set(re.findall(r"`([\w/]+\.py)`", MAP.read_text()))
    assert len(named) >= 20, named
    missing = sorted(n for n in named if not (ROOT / n).exists() and not (MAP.parent / n).exists())
    assert missing == [], f"ARCHITECTURE.md names files that do not exist: {missing}"


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
