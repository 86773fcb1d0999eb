"""The docs make claims a fresh clone must keep: links resolve, files and names exist, commands parse.

Checked in README.md, docs/*.md and benchmarks/*.md:

- every relative link (and image) points to a file of the repository, and its ``#anchor`` to a
  heading of that file (GitHub's anchor rules);
- every repository path written as code (``src/...``, ``examples/...``, ``benchmarks/...``,
  ``scripts/...``, ``tests/...``, ``docs/...``, ``requirements/...``), inline or in a code block,
  exists; so does every entry of the README's layout under ``src/multigpu/``;
- every code span that is a dotted ``multigpu.`` name imports (module) or resolves (attribute);
- every ``multigpu COMMAND --flag`` shown is a subcommand with that flag;
- the README stays short (at most 320 lines), and its quick start and the DataParallel guide's
  first example run as written.
"""

from __future__ import annotations

import argparse
import importlib
import re
import runpy
from pathlib import Path

import pytest
import torch

import multigpu
from multigpu.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]
_IDS = [str(p.relative_to(ROOT)) for p in DOCS]

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
_REPO_PATH = re.compile(r"(?<![\w./-])(?:src|tests|examples|benchmarks|scripts|docs|requirements)/[\w./-]*")
_DOTTED = re.compile(r"multigpu(?:\.\w+)+")
# Dotted names in the docs that are not Python objects.
_NOT_OBJECTS = {
    "multigpu.balance": "the name of the auto-balancer's logger",
    "multigpu.checksum": "a key of the safetensors metadata",
}


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


@pytest.mark.parametrize("doc", DOCS, ids=_IDS)
def test_relative_links_and_anchors_resolve(doc: Path) -> None:
    broken = []
    for target in _LINK.findall(_without_code_blocks(doc.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in {linked.name}")
    assert not broken, f"{doc.name}: broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=_IDS)
def test_repository_paths_in_code_exist(doc: Path) -> None:
    missing = sorted(
        {
            path
            for code in _code(doc.read_text())
            for path in _REPO_PATH.findall(code)
            if not (ROOT / path.rstrip(".")).exists()
        }
    )
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_every_entry_of_the_readme_layout_exists() -> None:
    layout = README.read_text().split("## Layout", 1)[1]
    block = _FENCE.search(layout)
    assert block is not None, "the README's Layout section has no code block"
    entries = [m.group(1) for m in re.finditer(r"^  ([\w.]+/?)\s", block.group(1), re.M)]
    assert len(entries) >= 10, entries
    missing = [e for e in entries if not (ROOT / "src" / "multigpu" / e).exists()]
    assert not missing, f"the README's layout lists {missing}, which src/multigpu/ does not have"


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=_IDS)
def test_dotted_multigpu_names_resolve(doc: Path) -> None:
    spans = _INLINE.findall(_without_code_blocks(doc.read_text()))
    names = {m.group(0) for span in spans if (m := _DOTTED.match(span)) and m.end() in (len(span), span.find("("))}
    unknown = sorted(n for n in names - set(_NOT_OBJECTS) if not _resolves(n))
    assert not unknown, f"{doc.name} names what multigpu does not have: {unknown}"


def _options(parser: argparse.ArgumentParser) -> tuple[set[str], dict[str, argparse.ArgumentParser]]:
    flags: set[str] = set()
    children: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        flags.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            children.update(action.choices)
    return flags, children


def _command_lines(text: str) -> list[str]:
    lines = []
    for code in _code(text):
        for raw in code.splitlines():
            line = raw.strip().removeprefix("$ ")
            if line.startswith("multigpu ") and not line.startswith("multigpu."):
                lines.append(line)
    return lines


@pytest.mark.parametrize("doc", DOCS, ids=_IDS)
def test_commands_shown_have_those_flags(doc: Path) -> None:
    _, commands = _options(build_parser())
    wrong = []
    for line in _command_lines(doc.read_text()):
        words = line.split("#", 1)[0].replace("[", " ").replace("]", " ").split()[1:]
        if not words or words[0].isupper() or words[0].endswith(":"):  # a placeholder, or program output
            continue
        if words[0].startswith("--"):
            top, _ = _options(build_parser())
            wrong += [f"{line}: multigpu has no {w}" for w in words if w.startswith("--") and w not in top]
            continue
        parser = commands.get(words[0])
        if parser is None:
            wrong.append(f"{line}: no subcommand {words[0]!r}")
            continue
        flags, children = _options(parser)
        for word in words[1:]:
            if word.endswith(".py"):  # the script's own arguments follow
                break
            if word in children:
                flags, children = _options(children[word])
            elif word.startswith("--") and word.split("=")[0] not in flags:
                wrong.append(f"{line}: multigpu {words[0]} has no {word}")
    assert not wrong, f"{doc.name}:\n" + "\n".join(wrong)


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
