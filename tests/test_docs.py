"""The docs make claims a fresh clone must keep: links resolve, files and names exist, commands parse.

Checked in README.md, ARCHITECTURE.md, docs/*.md and benchmarks/*.md:

- every relative link (and image) points to a file of the repository, and its ``#anchor`` to a
  heading of that file (GitHub's anchor rules);
- every repository path written as code (``src/...``, ``examples/...``, ``benchmarks/...``,
  ``scripts/...``, ``tests/...``, ``docs/...``, ``requirements/...``), inline or in a code block,
  exists; so does every folder of the README's layout (the package's map is ARCHITECTURE.md, checked by
  tests/test_layers.py);
- every code span that is a dotted ``multigpu.`` name imports (module) or resolves (attribute);
- every ``multigpu COMMAND --flag`` shown is a subcommand with that flag (the real parser), a value
  shown for a flag with choices is one of them; the flags shown after a repository script
  (``python benchmarks/x.py --flag``, ``python -m multigpu.x``, ``./scripts/gpu-check``,
  ``./scripts/demo``, ``multigpu launch ... examples/train.py --flag``) are ones its argparse declares;
- every ``MULTIGPU_*`` environment variable the README and guides name is read by the code or tests;
- every ``$ multigpu advise ...`` output block prints what it shows (run in-process);
- the README stays short (at most 320 lines); its quick start and the DataParallel guide's first
  example run as written, and the README's other fragments (and the guide's functional
  primitives) run given the few names they assume.

Each check loops over the documents and lists every failure at once (one test per check: the
suite's leak guard costs each test a garbage collection).
"""

from __future__ import annotations

import argparse
import ast
import functools
import pkgutil
import re
import runpy
import shlex
from pathlib import Path

import pytest
import torch

import multigpu
from multigpu.cli.main import build_parser
from multigpu.cli.main import main as multigpu_main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDES = [README, ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
DOCS = [*GUIDES, *sorted(set((ROOT / "benchmarks").glob("*.md")) - set(GUIDES))]

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
_REPO_PATH = re.compile(r"(?<![\w./-])(?:src|tests|examples|benchmarks|scripts|docs|requirements)/[\w./-]*")
_DOTTED = re.compile(r"multigpu(?:\.\w+)+")
_ENV_VAR = re.compile(r"\bMULTIGPU_[A-Z0-9_]+\b")
# What may stand before a command: environment assignments, nice, timeout, the venv's bin folder.
_PREFIX = re.compile(r"^(?:[A-Z][A-Z0-9_]*=\S*\s+|nice(?:\s+-n\s*-?\d+)?\s+|timeout\s+\d+\s+)*(?:\.venv/bin/)?")
# Dotted names in the docs that are not Python objects.
_NOT_OBJECTS = {
    "multigpu.balance": "the name of the auto-balancer's logger",
    "multigpu.checksum": "a key of the safetensors metadata",
}
# Commands whose arguments another program parses (pytest's own flags).
_FOREIGN = ("python -m pytest",)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _without_code_blocks(text: str) -> str:
    return _FENCE.sub("", text)


def _code(text: str) -> list[str]:
    """Every fenced block and every inline code span of ``text``."""
    return _FENCE.findall(text) + _INLINE.findall(_without_code_blocks(text))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _without_code_blocks(path.read_text()).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if not match:
            continue
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_slug_follows_githubs_rules() -> None:
    assert _slug("DDP's knobs, sync BatchNorm, compile") == "ddps-knobs-sync-batchnorm-compile"
    assert _slug("Inspect and convert (`multigpu ckpt`)") == "inspect-and-convert-multigpu-ckpt"
    assert _slug("Checkpoint save + load with checksums (issue 12)") == "checkpoint-save--load-with-checksums-issue-12"


def test_the_readme_stays_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= 320, f"README.md has {lines} lines; keep it at most 320 and move detail into docs/"


def test_relative_links_and_anchors_resolve() -> None:
    broken = []
    for doc in DOCS:
        for target in _LINK.findall(_without_code_blocks(doc.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            linked = (doc.parent / file_part).resolve() if file_part else doc
            if not linked.exists():
                broken.append(f"{_rel(doc)}: {target}: no file {linked}")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{_rel(doc)}: {target}: no heading with anchor #{anchor} in {linked.name}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_repository_paths_in_code_exist() -> None:
    missing = sorted(
        f"{_rel(doc)}: {path}"
        for doc in DOCS
        for path in {p for code in _code(doc.read_text()) for p in _REPO_PATH.findall(code)}
        if not (ROOT / path.rstrip(".")).exists()
    )
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_every_entry_of_the_readme_layout_exists() -> None:
    """The repository's folders as the README lists them (the package's own map: ARCHITECTURE.md, test_layers)."""
    layout = README.read_text().split("## Layout", 1)[1]
    block = _FENCE.search(layout)
    assert block is not None, "the README's Layout section has no code block"
    entries = [m.group(1) for m in re.finditer(r"^([\w./]+)\s", block.group(1), re.M)]
    assert len(entries) >= 7, entries
    missing = [e for e in entries if not (ROOT / e).exists()]
    assert not missing, f"the README's layout lists {missing}, which the repository does not have"


def _resolves(name: str) -> bool:
    try:
        pkgutil.resolve_name(name)
    except (ImportError, AttributeError, ValueError):
        return False
    return True


def test_dotted_multigpu_names_resolve() -> None:
    unknown = []
    for doc in DOCS:
        spans = _INLINE.findall(_without_code_blocks(doc.read_text()))
        names = {m.group(0) for s in spans if (m := _DOTTED.match(s)) and m.end() in (len(s), s.find("("))}
        unknown += [f"{_rel(doc)}: {n}" for n in sorted(names - set(_NOT_OBJECTS)) if not _resolves(n)]
    assert not unknown, "names multigpu does not have:\n" + "\n".join(unknown)


def test_environment_variables_named_are_read_somewhere() -> None:
    # RESULTS.md records commands as they were run at past revisions; the guides must be current.
    sources = "\n".join(
        path.read_text()
        for folder in ("src", "tests", "scripts", "benchmarks", "examples")
        for path in (ROOT / folder).rglob("*")
        if path.suffix in {".py", ".sh", ""} and path.is_file() and path.name != "test_docs.py"
    )
    unread = sorted(
        f"{_rel(doc)}: {name}"
        for doc in GUIDES
        for name in set(_ENV_VAR.findall(doc.read_text()))
        if name not in sources
    )
    assert not unread, "environment variables nothing reads:\n" + "\n".join(unread)


# --- commands and their flags ------------------------------------------------------------------


@functools.cache
def _multigpu_parser() -> argparse.ArgumentParser:
    return build_parser()


def _options(parser: argparse.ArgumentParser) -> tuple[dict[str, argparse.Action], dict[str, argparse.ArgumentParser]]:
    flags: dict[str, argparse.Action] = {}
    children: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        flags.update(dict.fromkeys(action.option_strings, action))
        if isinstance(action, argparse._SubParsersAction):
            children.update(action.choices)
    return flags, children


@functools.cache
def _declared_flags(script: Path) -> frozenset[str]:
    """The option strings a script's argparse declares (read from its source, nothing imported)."""
    flags = {"-h", "--help"}
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            flags.update(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
    return frozenset(flags)


def _module_file(module: str) -> Path | None:
    base = ROOT / "src" / Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.exists():
            return candidate
    return None


def _commands(text: str) -> list[list[str]]:
    """Each command line shown in code, as words: prefixes, comments and a ``$ `` prompt removed."""
    found = []
    for code in _code(text):
        for raw in code.splitlines():
            line = _PREFIX.sub("", raw.strip().removeprefix("$ ")).split(" #", 1)[0]
            if line.startswith(_FOREIGN) or not re.match(r"(multigpu |python3? |\./scripts/)", line):
                continue
            second = [*line.split(), ""][1]
            if line.startswith("multigpu") and (second.isupper() or second.endswith(":")):
                continue  # a placeholder (multigpu COMMAND) or program output (multigpu launch: ...)
            try:
                words = shlex.split(line.replace("[", " ").replace("]", " "))
            except ValueError:
                words = line.split()
            found.append(words)
    return found


def _flag_errors(words: list[str], flags: dict[str, argparse.Action] | frozenset[str], where: str) -> list[str]:
    """Flags in ``words`` that ``flags`` lacks, and literal values outside a flag's choices."""
    wrong = []
    for word, following in zip(words, [*words[1:], ""]):
        name = word.split("=", 1)[0]
        if not word.startswith("--") or word == "--":
            continue
        if name not in flags:
            wrong.append(f"{where} has no {name}")
            continue
        action = flags.get(name) if isinstance(flags, dict) else None
        value = word.split("=", 1)[1] if "=" in word else following
        literal = (
            value and not value.startswith("-") and "|" not in value and not value.isupper() and "..." not in value
        )
        if action is not None and action.choices and action.option_strings and literal and value not in action.choices:
            wrong.append(f"{where} {name}: {value!r} is not one of {sorted(action.choices)}")
    return wrong


def _script_errors(words: list[str]) -> list[str]:
    """The flags after a repository script, checked against what that script declares."""
    for i, word in enumerate(words):
        if word.endswith(".py") and (ROOT / word).is_file():
            return _flag_errors(words[i + 1 :], _declared_flags(ROOT / word), word)
    return []


def _multigpu_errors(words: list[str]) -> list[str]:
    flags, commands = _options(_multigpu_parser())
    if words[1].startswith("-"):
        return _flag_errors(words[1:], flags, "multigpu")
    parser = commands.get(words[1])
    if parser is None:
        return [f"no subcommand {words[1]!r}"]
    flags, children = _options(parser)
    path = f"multigpu {words[1]}"
    for i, word in enumerate(words[2:], start=2):
        if word in children:
            flags, children = _options(children[word])
            path += f" {word}"
        elif word.endswith(".py"):  # the script's own arguments follow
            return _flag_errors(words[2:i], flags, path) + _script_errors(words)
    return _flag_errors(words[2:], flags, path)


def _command_errors(words: list[str]) -> list[str]:
    if words[0] == "multigpu":
        return _multigpu_errors(words)
    if words[0] == "./scripts/demo":
        return _multigpu_errors(["multigpu", "demo", *words[1:]])
    if words[0] == "./scripts/gpu-check":
        return _flag_errors(words[1:], _declared_flags(ROOT / "scripts" / "gpu_check.py"), words[0])
    if words[0].startswith("./scripts/"):
        return [] if (ROOT / words[0]).is_file() else [f"no script {words[0]}"]
    if len(words) > 2 and words[1] == "-m" and words[2].startswith("multigpu"):
        module = _module_file(words[2])
        if module is None:
            return [f"no module {words[2]} to run"]
        return _flag_errors(words[3:], _declared_flags(module), words[2])
    return _script_errors(words)


def test_commands_shown_have_those_flags() -> None:
    wrong = [
        f"{_rel(doc)}: {' '.join(words)}: {error}"
        for doc in DOCS
        for words in _commands(doc.read_text())
        for error in _command_errors(words)
    ]
    assert not wrong, "commands the code does not accept:\n" + "\n".join(wrong)


def test_the_flag_check_catches_what_it_should() -> None:
    assert _command_errors(["multigpu", "advise", "--gpus", "2"]) == ["multigpu advise has no --gpus"]
    assert _command_errors(["multigpu", "launch", "--strategy", "zero3", "x.py"])[0].startswith(
        "multigpu launch --strategy: 'zero3' is not one of"
    )
    assert _command_errors(["multigpu", "launch", "examples/train.py", "--epoch", "1"]) == [
        "examples/train.py has no --epoch"
    ]
    assert _command_errors(["python", "benchmarks/balance.py", "--nope"]) == ["benchmarks/balance.py has no --nope"]
    assert _command_errors(["./scripts/gpu-check", "--skip", "demo", "--outdir", "x"]) == [
        "./scripts/gpu-check has no --outdir"
    ]
    assert _command_errors(["python", "-m", "multigpu.planning.calibrate", "--x"]) == [
        "multigpu.planning.calibrate has no --x"
    ]
    assert _command_errors(["./scripts/demo", "--dtype", "float16"])[0].startswith("multigpu demo --dtype: 'float16'")
    assert _commands("`MULTIGPU_LONG=1 nice -n 10 .venv/bin/python benchmarks/x.py --a 1  # note`") == [
        ["python", "benchmarks/x.py", "--a", "1"]
    ]


def _shown_advise_runs(text: str) -> list[tuple[list[str], list[str]]]:
    """(arguments, output lines) of every fenced block that shows ``$ multigpu advise ...`` and its output."""
    runs = []
    for block in _FENCE.findall(text):
        first, *output = block.splitlines()
        if first.startswith("$ multigpu advise "):
            runs.append((shlex.split(first.removeprefix("$ multigpu ")), output))
    return runs


def test_advise_outputs_shown_are_what_it_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A shown line must be printed as it stands; one ending in "..." is a prefix; a lone "..." skips rows.
    differ = []
    runs = [(doc, run) for doc in GUIDES for run in _shown_advise_runs(doc.read_text())]
    assert runs, "no document shows the output of multigpu advise"
    for doc, (args, shown) in runs:
        capsys.readouterr()
        assert multigpu_main([*args, "--out", str(tmp_path), "--no-figure"]) == 0
        printed = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
        for line in (s.rstrip() for s in shown):
            if not line.strip() or line.strip() == "...":
                continue
            prefix = line.removesuffix("...").rstrip(" ,") if line.endswith("...") else None
            if not any(p == line or (prefix is not None and p.startswith(prefix)) for p in printed):
                differ.append(f"{_rel(doc)}: multigpu {' '.join(args)}: prints no line {line!r}")
    assert not differ, "\n".join(differ)


_CONTEXT = """
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import multigpu

def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

dataset = TensorDataset(torch.randn(128, 8), torch.randint(0, 3, (128,)))
model, x, y = build_model(), torch.randn(16, 8), torch.randint(0, 3, (16,))
opt = optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
step = 1
"""


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_the_readmes_fragments_run_in_a_small_context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every README fragment after the quick start (which runs on its own below), and the guide's
    # functional primitives, each in a fresh namespace holding the names they assume.
    fragments = _python_blocks(README.read_text().split("## Quick start", 1)[1])[1:]
    fragments += [b for b in _python_blocks((ROOT / "docs" / "dataparallel.md").read_text()) if "scatter(" in b]
    assert len(fragments) >= 5, fragments
    monkeypatch.chdir(tmp_path)
    for fragment in fragments:
        names: dict[str, object] = {"__name__": "__main__"}
        exec(compile(_CONTEXT + fragment, "<README fragment>", "exec"), names)
        del names


def _first_python_block(text: str) -> str:
    block = re.search(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert block is not None
    return block.group(1)


@pytest.mark.parametrize(
    ("doc", "after"),
    [(README, "## Quick start"), (ROOT / "docs" / "dataparallel.md", "# `multigpu.DataParallel`")],
    ids=["README quick start", "docs/dataparallel.md"],
)
def test_the_first_example_runs_as_written(
    doc: Path, after: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _first_python_block(doc.read_text().split(after, 1)[1])
    script = tmp_path / "example.py"
    script.write_text(source)
    monkeypatch.chdir(tmp_path)
    # torch sets this the first time it looks for its compile cache: keep it out of os.environ for good
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    names = runpy.run_path(str(script), run_name="__main__")
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    bare = multigpu.unwrap(names["model"])
    assert bare is not names["model"], "the example trains a wrapped model"
    assert list(saved) == list(bare.state_dict()), "the saved keys are the bare model's (no module. prefix)"
    bare.load_state_dict(saved)
