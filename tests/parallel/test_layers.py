"""The engine sits below checkpoint/, session/, distributed/ and cli/: it imports none of them."""

from __future__ import annotations

import ast
from pathlib import Path

import multigpu.parallel

ABOVE = ("multigpu.checkpoint", "multigpu.session", "multigpu.distributed", "multigpu.cli", "multigpu.planning")


def test_the_engine_imports_nothing_above_it() -> None:
    found = []
    for path in sorted(Path(multigpu.parallel.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.name}: {n}" for n in names if n.startswith(ABOVE)]
    assert found == []
