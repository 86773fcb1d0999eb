"""Tests start processes one way: through tests/launching.py, and distributed runs through ``multigpu launch``.

Checked on the source of every test module: no ``subprocess.Popen``, no ``multiprocessing`` or
``torch.multiprocessing`` process, no ``mp.spawn``, no Python interpreter started by
``subprocess.run`` and no torchrun outside tests/launching.py. System tools a test sets the stage
with (``ip netns``, ``mount``) are not test processes and stay allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
HARNESS = TESTS / "launching.py"
_STARTERS = {"Popen", "Process", "spawn", "start_processes", "fork", "posix_spawn"}
_RUNNERS = {"run", "call", "check_call", "check_output"}


def _starts(path: Path) -> list[str]:
    """``file:line what`` for each place ``path`` starts a process itself."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value in ("torch.distributed.run", "torchrun"):
            found.append(f"{path.name}:{node.lineno} names torchrun")
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name = node.func.attr
        if name in _STARTERS:
            found.append(f"{path.name}:{node.lineno} calls {name}")
        elif name in _RUNNERS and node.args and _runs_python(node.args[0]):
            found.append(f"{path.name}:{node.lineno} runs a Python interpreter with subprocess.{name}")
    return found


def _runs_python(argv: ast.expr) -> bool:
    first = argv.elts[0] if isinstance(argv, ast.List) and argv.elts else None
    return isinstance(first, ast.Attribute) and first.attr == "executable"


def test_only_the_harness_starts_processes() -> None:
    offenders = [
        hit
        for path in sorted(TESTS.rglob("*.py"))
        if path not in (HARNESS, Path(__file__).resolve())
        for hit in _starts(path)
    ]
    assert offenders == [], "start processes through tests/launching.py (start_python, run_command, multigpu_launch)"


def test_the_check_sees_each_way_of_starting_a_process(tmp_path: Path) -> None:
    source = tmp_path / "t.py"
    source.write_text(
        "import subprocess, sys\n"
        "subprocess.Popen(['x'])\n"
        "subprocess.run([sys.executable, '-c', 'pass'])\n"
        "subprocess.run(['ip', 'link'])\n"  # a system tool: allowed
        "mp.spawn(f, nprocs=2)\n"
        "args = ['-m', 'torch.distributed.run']\n"
    )
    assert [hit.split()[1:] for hit in _starts(source)] == [
        ["calls", "Popen"],
        ["runs", "a", "Python", "interpreter", "with", "subprocess.run"],
        ["calls", "spawn"],
        ["names", "torchrun"],
    ]
