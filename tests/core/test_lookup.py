"""core.lookup: the one lookup-or-error of every table of choices, and the places that ask it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import multigpu
from multigpu.core.lookup import lookup
from multigpu.errors import ConfigError, DeviceError

SRC = Path(multigpu.__file__).parent


def test_a_name_in_the_table_is_its_entry() -> None:
    assert lookup({"a": 1, "b": None}, "b", "x={value!r} is not one of {choices}") is None


def test_a_missing_name_raises_the_callers_error_naming_the_value_the_choices_and_the_fix() -> None:
    with pytest.raises(DeviceError, match=r"^kind='tpu' is not one of cpu, cuda; register it$"):
        lookup({"cpu": 1, "cuda": 2}, "tpu", "kind={value!r} is not one of {choices}; register it", error=DeviceError)
    with pytest.raises(ConfigError, match=r"^p='fp8' is not one of \['bf16', 'fp32'\]; use e.g\. p='bf16'$"):
        lookup(
            {"fp32": 0, "bf16": 1},
            "fp8",
            "p={value!r} is not one of {choices}; use e.g. {eg}",
            choices=["bf16", "fp32"],
            eg="p='bf16'",
        )


def test_the_value_is_shown_as_typed_and_braces_in_it_are_text() -> None:
    with pytest.raises(ConfigError, match=re.escape("unknown GPU 'A-{0}'; choose one of a100")):
        lookup({"a100": 1}, "a{0}", "unknown GPU {value!r}; choose one of {choices}", shown="A-{0}")


def test_an_unhashable_name_is_simply_not_there() -> None:
    with pytest.raises(ConfigError, match=r"x=\['a'\] is not one of a"):
        lookup({"a": 1}, ["a"], "x={value!r} is not one of {choices}")


def test_a_message_that_hides_the_value_or_the_choices_is_the_callers_mistake() -> None:
    with pytest.raises(ValueError, match="must show"):
        lookup({"a": 1}, "b", "no such thing")


def test_no_module_hand_writes_a_lookup_or_error() -> None:
    """``if x not in TABLE: raise ...Error(f"... is not one of ...")``: ask core.lookup instead."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            text = ast.unparse(node.exc)
            if re.search(
                r"((is not|choose|use) one of|pick from) \{", text
            ):  # a table's choices formatted in: a lookup
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert found == [], f"look the name up with multigpu.core.lookup.lookup: {found}"


# a literal list that is a parse, not a table a user picks from: an environment flag's spellings
_NOT_TABLES = {("runtime/worker_env.py", ("", "0", "1"))}


def _names_checked_by_hand(tree: ast.AST) -> list[tuple[int, tuple[str, ...]]]:
    """``if x not in ("a", "b"): raise ...``: a table of names written inline and refused by hand."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or not any(isinstance(b, ast.Raise) for b in node.body):
            continue
        for compare in (c for c in ast.walk(node.test) if isinstance(c, ast.Compare)):
            for op, right in zip(compare.ops, compare.comparators):
                names = right.elts if isinstance(op, ast.NotIn) and isinstance(right, (ast.Tuple, ast.List)) else []
                if names and all(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in names):
                    found.append((node.lineno, tuple(n.value for n in names)))  # type: ignore[attr-defined]
    return found


def test_no_module_refuses_a_name_against_an_inline_list_by_hand() -> None:
    found = [
        f"{path.relative_to(SRC)}:{line} {names}"
        for path in sorted(SRC.rglob("*.py"))
        for line, names in _names_checked_by_hand(ast.parse(path.read_text()))
        if (str(path.relative_to(SRC)), names) not in _NOT_TABLES
    ]
    assert found == [], f"name the table and refuse through multigpu.core.lookup.lookup: {found}"


def test_the_inline_list_guard_sees_one() -> None:
    tree = ast.parse('if x not in ("static", "c10d"):\n    raise E(x)\nif y not in (1, 2):\n    raise E(y)\n')
    assert _names_checked_by_hand(tree) == [(1, ("static", "c10d"))]
