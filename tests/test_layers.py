"""ARCHITECTURE.md's layer table, checked on the imports of every module, and no import circle between files.

The table is read from ARCHITECTURE.md itself, so the map and the check cannot drift apart. A module
may import the packages of the layers below its own, never one above it, and never a sibling on its
own line: the engine (parallel) and the checkpoints do not know each other. A failure names the file.

Every import counts: at the top of a file, inside a function, and under ``if TYPE_CHECKING:``. A lazy
import only moves a circle from import time to call time (the two files still cannot be read, tested or
moved apart alone), and the circle issue 30 named (launch, torchrun, preemption) was closed by
``TYPE_CHECKING`` imports alone. Every spelling counts: ``from multigpu.x import y``, ``import multigpu.x``
(``as y``), ``from multigpu import x``, and ``import multigpu`` followed by ``multigpu.x`` or a public name
the package re-exports (``multigpu.Session`` is :mod:`multigpu.session`'s).
"""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

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


# the package's public names -> the module each comes from (what ``multigpu.Session`` imports)
FACADE: dict[str, str] = dict(multigpu._SOURCES)


def _modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every ``multigpu`` module ``path`` imports, dotted, whatever the spelling (module docstring); relative
    imports resolved. ``from multigpu.x import y`` names ``multigpu.x.y`` where that is a module."""
    tree = ast.parse(path.read_text())
    here = ["multigpu", *path.relative_to(root).with_suffix("").parts] if path.is_relative_to(root) else ["m"]
    package = here if here[-1] == "__init__" else here[:-1]
    found: set[str] = set()
    facade: set[str] = set()  # local names bound to the package itself
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "multigpu" or alias.name.startswith("multigpu."):
                    if alias.asname is None and "." in alias.name:
                        found.add(alias.name)  # binds 'multigpu' too, but its uses are attribute chains below
                        facade.add("multigpu")
                    elif alias.name == "multigpu":
                        facade.add(alias.asname or "multigpu")
                    else:
                        found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
                base = base.removesuffix(".__init__")
            if base == "multigpu":  # from multigpu import x: a package, or a public name re-exported
                found |= {FACADE.get(a.name, f"multigpu.{a.name}") for a in node.names if not a.name.startswith("__")}
            elif base.startswith("multigpu."):
                found |= {f"{base}.{a.name}" if _is_module(f"{base}.{a.name}", root) else base for a in node.names}
    values = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in facade:
            if not node.attr.startswith("__"):  # multigpu.__version__ is the package's own
                found.add(FACADE.get(node.attr, f"multigpu.{node.attr}"))
        elif isinstance(node, ast.Name) and node.id in facade and id(node) not in values:
            found |= set(FACADE.values())  # the package passed around whole: all it re-exports
    return found


def _is_module(dotted: str, root: Path) -> bool:
    relative = Path(*dotted.split(".")[1:])
    return (root / relative).with_suffix(".py").is_file() or (root / relative / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """The units (packages and top-level modules of multigpu) ``path`` imports."""
    return {m.split(".")[1] for m in _modules(path) if m.count(".") >= 1}


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


@pytest.mark.parametrize(
    ("source", "units"),
    [
        ("from multigpu.session import Session\n", {"session"}),
        ("import multigpu.cli.main\n", {"cli"}),
        ("import multigpu.cli.main as entry\n", {"cli"}),
        ("from multigpu import launcher\n", {"launcher"}),
        ("from multigpu import Session\n", {"session"}),  # a public name: the module it comes from
        ("import multigpu\nmultigpu.Session()\n", {"session"}),
        ("import multigpu as mg\nmg.launcher.launch\n", {"launcher"}),
        ("import multigpu\nprint(multigpu.__version__)\n", set()),  # the package's own
        ("import multigpu\nfind(multigpu)\n", {m.split(".")[1] for m in FACADE.values()}),
        ("def f():\n    import multigpu\n    return multigpu.launch_function\n", {"launcher"}),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from multigpu.cli import main\n", {"cli"}),
    ],
)
def test_the_check_sees_every_spelling_of_an_import(tmp_path: Path, source: str, units: set[str]) -> None:
    (tmp_path / "m.py").write_text(source)
    assert _imports(tmp_path / "m.py") == units


def _module_graph(root: Path = ROOT) -> dict[str, dict[str, Path]]:
    """module -> each multigpu module it imports -> the file that does (every file under ``root``)."""
    graph: dict[str, dict[str, Path]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[name] = {target: path for target in _modules(path, root) if target != name}
    return graph


def _cycles(graph: dict[str, dict[str, Path]]) -> list[list[str]]:
    """One circle per strongly connected group of modules, as ``[a, b, ..., a]`` (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, {}):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while (member := stack.pop()) != node:
                group.append(member)
            if group:
                groups.append([node, *group])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_circle(graph, set(group), min(group)) for group in groups]


def _circle(graph: dict[str, dict[str, Path]], group: set[str], start: str) -> list[str]:
    """A shortest path from ``start`` back to itself inside ``group`` (breadth first)."""
    came: dict[str, str] = {}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for target in sorted(graph[node]):
            if target == start:
                path = [node]
                while path[-1] != start:
                    path.append(came[path[-1]])
                return [*reversed(path), start]
            if target in group and target not in came:
                came[target] = node
                todo.append(target)
    raise AssertionError(f"no circle through {start} in {group}")


def _shown(graph: dict[str, dict[str, Path]], circle: list[str], root: Path = ROOT) -> str:
    return (
        " -> ".join(circle)
        + "  ("
        + ", ".join(f"{graph[a][b].relative_to(root.parent)} imports {b}" for a, b in itertools.pairwise(circle))
        + ")"
    )


def test_no_two_files_import_each_other_even_through_others() -> None:
    graph = _module_graph()
    circles = [_shown(graph, circle) for circle in _cycles(graph)]
    assert circles == [], (
        "import circles between files (break each: move what both need into a module of its own; each line is "
        "one circle of a group of files that all reach each other, the rest of the group shows once it is broken):\n"
        + "\n".join(circles)
    )


def test_the_circle_check_finds_and_prints_a_circle(tmp_path: Path) -> None:
    package = tmp_path / "multigpu"
    (package / "a").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a" / "__init__.py").write_text("")
    (package / "a" / "one.py").write_text("from multigpu.a.two import f\n")
    (package / "a" / "two.py").write_text("def f():\n    from multigpu.a import three\n")
    (package / "a" / "three.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import multigpu.a.one\n"
    )
    (package / "a" / "alone.py").write_text("from multigpu.a import one\n")
    graph = _module_graph(package)
    circles = _cycles(graph)
    assert circles == [["multigpu.a.one", "multigpu.a.two", "multigpu.a.three", "multigpu.a.one"]]
    shown = _shown(graph, circles[0], package)
    assert "multigpu/a/two.py imports multigpu.a.three" in shown
