"""Property: damage a valid checkpoint at random; every reader succeeds with the original data or refuses cleanly.

The checkpoints are real (a trained MLP, SGD with momentum, StepLR, a GradScaler, two steps of
a Checkpointer, and weights files in both formats). Hypothesis picks a class of damage and its
details:

* malformed weights files: truncate, flip bytes (anywhere, or in the header), splice in bytes of
  another checkpoint, lie in the length field, insert or delete bytes, zero a range; and
  well-formed variants: a torch zip whose pickle is damaged and re-zipped with valid CRCs, a
  safetensors header edited and its checksum removed (a file from elsewhere);
* damaged full-state folders: the same damage to ``state.pt`` or ``model.safetensors``, files
  swapped within and between steps, a file deleted, folders renamed, a state that would run code;
* hostile folder names: stray entries next to the checkpoints (huge or odd step names, files and
  symlinks under step names, fake aside folders).

Then ``multigpu.load``, ``Checkpointer.resume``, ``ckpt inspect`` and ``ckpt convert`` each either
succeed (with the original data, unless the damage made a different well-formed file) or raise
:class:`CheckpointError` (CLI: exit 1, one line), leave model/optimizer/scheduler/scaler/RNG
untouched when they refuse, change nothing on disk, run no code from the file, and finish within
a time bound.

CI runs a short fixed-seed profile (one example per class and kind). ``MULTIGPU_CORRUPTION_CASES=13000``
runs the long one, spread evenly over the kinds (kinds with few distinct variants, such as
swapping two files, stop when hypothesis has tried them all; about 11,000 cases run);
``MULTIGPU_CORRUPTION_REPORT=path.json`` also writes the counts there (``pytest -s`` prints them).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import random
import shutil
import struct
import tempfile
import time
import zipfile
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import multigpu.checkpoint as ckpt
from multigpu.checkpoint.formats import read_tensors
from multigpu.checkpoint.weights import summarize
from multigpu.cli.main import main
from multigpu.errors import CheckpointError
from tests.checkpoint import _craft
from tests.checkpoint import _training as tr

CASES = int(os.environ.get("MULTIGPU_CORRUPTION_CASES", "30"))
LONG = "MULTIGPU_CORRUPTION_CASES" in os.environ
TIME_BOUND_S = 60.0  # a hang detector, not a speed target: every operation here takes milliseconds
CLASSES = ("malformed weights file", "damaged full-state folder", "hostile folder names")
COUNTS: dict[str, Counter[str]] = defaultdict(Counter)

pytestmark = pytest.mark.timeout(120 + CASES)


class _Payload:
    """Unpickling it creates the file it names: proof that code from a file ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (Path(self.marker),))


# ---------------------------------------------------------------- the valid checkpoints


class Template:
    """Valid files, built once, and the original data each must load to."""

    def __init__(self, root: Path) -> None:
        self.root = root
        tr.seed_everything(5)
        parts = tr.build_parts()
        checkpointer = ckpt.Checkpointer(folder=root / "run", keep_last=None)
        self.steps: dict[int, dict[str, Any]] = {}
        for step in (1, 2):
            tr.train_step(parts, step - 1)
            checkpointer.save(
                step=step,
                model=parts.model,
                optimizer=parts.optimizer,
                scheduler=parts.scheduler,
                scaler=parts.scaler,
                epoch=0,
                data_position={"batch": step},
            )
            self.steps[step] = _state_of(parts)
        self.weights = copy.deepcopy(parts.model.state_dict())
        ckpt.save(parts.model, root / "w.safetensors")
        ckpt.save(parts.model, root / "w.pt")


def _state_of(parts: tr.Parts) -> dict[str, Any]:
    return copy.deepcopy(
        {
            "model": parts.model.state_dict(),
            "optimizer": parts.optimizer.state_dict(),
            "scheduler": parts.scheduler.state_dict(),
            "scaler": parts.scaler.state_dict(),
        }
    )


@pytest.fixture(scope="module")
def template() -> Iterator[Template]:
    with tempfile.TemporaryDirectory() as root:
        yield Template(Path(root))


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    yield
    table = {cls: dict(sorted(COUNTS[cls].items())) for cls in CLASSES if COUNTS[cls]}
    print("\n[corruption] " + json.dumps(table, indent=1))
    if os.environ.get("MULTIGPU_CORRUPTION_REPORT"):
        Path(os.environ["MULTIGPU_CORRUPTION_REPORT"]).write_text(json.dumps(table, indent=1))


# ---------------------------------------------------------------- damage


def _header_end(data: bytes) -> int:
    n = max(len(data), 1)
    if data[:2] == b"PK":  # a torch zip: its first bytes are data.pkl's local header and the pickle
        return min(n, 512)
    return min(n, 8 + int.from_bytes(data[:8], "little")) if len(data) >= 8 else n


def _damage_bytes(data: bytes, kind: str, draw: Callable[[Any], Any], other: bytes) -> bytes:
    """``data`` with one kind of damage (see BYTE_DAMAGE) whose details hypothesis draws."""
    n = max(len(data), 1)
    head = _header_end(data)
    out = bytearray(data)
    if kind == "truncate":
        return data[: draw(st.integers(0, n - 1))]
    if kind in ("flip", "flip header"):
        limit = head if kind == "flip header" and head < n else n
        for _ in range(draw(st.integers(1, 8))):
            out[draw(st.integers(0, limit - 1))] ^= draw(st.integers(1, 255))
        return bytes(out)
    if kind == "splice":
        start, length = draw(st.integers(0, n - 1)), draw(st.integers(1, 256))
        source = draw(st.integers(0, max(len(other) - length, 0)))
        out[start : start + length] = other[source : source + length]
        return bytes(out)
    if kind == "length":
        value = draw(st.sampled_from([0, 1, 2, n - 8, n - 7, n, 2**31, 100_000_001, 2**63, 2**64 - 1]))
        return struct.pack("<Q", max(value, 0) % 2**64) + data[8:]
    at = draw(st.integers(0, n - 1))
    if kind == "insert":
        return data[:at] + draw(st.binary(min_size=1, max_size=64)) + data[at:]
    length = draw(st.integers(1, 512))
    if kind == "delete":
        return data[:at] + data[at + length :]
    return data[:at] + bytes(min(length, n - at)) + data[at + length :]


def _rezip_with_damaged_pickle(data: bytes, draw: Callable[[Any], Any]) -> bytes:
    # Valid CRCs around a damaged pickle: exercises the checks behind the zip layer.
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        records = {i.filename: archive.read(i.filename) for i in archive.infolist()}
    name = next(k for k in records if k.endswith("/data.pkl"))
    pickle_bytes = bytearray(records[name])
    for _ in range(draw(st.integers(1, 4))):
        pickle_bytes[draw(st.integers(0, len(pickle_bytes) - 1))] ^= draw(st.integers(1, 255))
    records[name] = bytes(pickle_bytes)
    return _craft.zip_bytes(records)


def _edit_header_without_checksum(data: bytes, draw: Callable[[Any], Any]) -> bytes:
    # A safetensors file from elsewhere (no checksum) with one header field edited.
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    header.get("__metadata__", {}).pop("multigpu.checksum", None)
    key = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "key", "drop", "metadata"]))
    odd = draw(st.sampled_from([-1, 0, 1, 3, 2**40, 2**64, "x", None, True, 1.5, [], [1, 2], {"a": 1}]))
    if field == "dtype":
        header[key]["dtype"] = draw(st.sampled_from(["F16", "F64", "I8", "BOOL", "F4", "X", odd]))
    elif field == "shape":
        header[key]["shape"] = draw(st.sampled_from([[odd], [48, odd], [], odd]))
    elif field == "data_offsets":
        header[key]["data_offsets"] = draw(st.sampled_from([[0, odd], [odd, 0], [odd], odd]))
    elif field == "key":
        other = draw(st.sampled_from(sorted(header)))
        header[other] = header.pop(key)
    elif field == "drop":
        del header[key]
    else:
        header["__metadata__"] = draw(st.sampled_from([{"step": odd}, {"multigpu.aliases": "{"}, odd]))
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + length :]


def _payload_file(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"step": 1, "hook": _Payload(str(marker))}, buffer)
    return buffer.getvalue()


# ---------------------------------------------------------------- the operations and the property


class Case:
    """One damaged copy of the template and what happened to each operation on it."""

    def __init__(self, template: Template, where: Path, cls: str) -> None:
        self.template, self.where, self.cls = template, where, cls
        self.marker = where / "code-ran"
        self.altered = False  # a well-formed variant: success need not give the original data

    def outcome(self, name: str, ok: bool, original: bool) -> None:
        if ok:
            label = "succeeded, original data" if original else "succeeded, altered well-formed file"
        else:
            label = "refused (CheckpointError)"
        COUNTS[self.cls][f"{name}: {label}"] += 1
        COUNTS[self.cls]["operations"] += 1

    def violation(self, what: str) -> None:
        COUNTS[self.cls][what] += 1
        raise AssertionError(what)

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        yield
        if time.monotonic() - start > TIME_BOUND_S:
            self.violation(f"unbounded time ({name})")


def _sentinel_model() -> nn.Module:
    model = tr.build_model()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.25)
    return model


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return bool(a == b)


def _disk(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): zlib.crc32(p.read_bytes()) if p.is_file() and not p.is_symlink() else -1
        for p in sorted(root.rglob("*"))
        if "out" not in p.relative_to(root).parts
    }


def _cli(args: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, err.getvalue()


def _check_cli(case: Case, name: str, args: list[str]) -> bool:
    with case.timed(name):
        code, err = _cli(args)
    if code not in (0, 1) or "Traceback" in err or (code == 1 and len(err.strip().splitlines()) != 1):
        case.violation(f"untyped error ({name}: exit {code}, {err[-300:]!r})")
    return code == 0


def check_weights_file(case: Case, path: Path) -> None:
    original = case.template.weights
    model = _sentinel_model()
    before = copy.deepcopy(model.state_dict())
    with case.timed("load"):
        try:
            ckpt.load(model, path)
            ok = True
        except CheckpointError:
            ok = False
    if not ok and not _equal(model.state_dict(), before):
        case.violation("half-applied load")
    same = _equal(model.state_dict(), original)
    if ok and not same and not case.altered:
        case.violation("load succeeded with other data")
    case.outcome("load", ok, same)
    _check_summary(case, path)
    out = case.where / "out" / "converted.safetensors"
    if _check_cli(case, "convert", ["ckpt", "convert", str(path), str(out)]):
        same = _equal(dict(read_tensors(out)[0]), dict(original))
        if not same and not case.altered:
            case.violation("convert succeeded with other data")
        case.outcome("convert", True, same)
    else:
        case.outcome("convert", False, False)


def _check_summary(case: Case, path: Path) -> None:
    with case.timed("inspect"):
        try:
            summary = summarize(path)
            ok = True
        except CheckpointError:
            ok = False
    same = ok and sorted((t.key, t.shape) for t in summary.tensors) == sorted(
        (k, tuple(v.shape)) for k, v in case.template.weights.items()
    )
    if ok and not same and not case.altered:
        case.violation("inspect described other data")
    if _check_cli(case, "inspect", ["ckpt", "inspect", str(path)]) != ok:
        case.violation("inspect: library and CLI disagree")
    case.outcome("inspect", ok, same)


def _random_state() -> tuple[Any, ...]:
    return (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())


def check_folder(case: Case, folder: Path) -> None:
    parts = tr.build_parts(_sentinel_model())
    before, rng_before = _state_of(parts), _random_state()
    with case.timed("resume"):
        try:
            resumed = ckpt.Checkpointer(folder=folder).resume(
                model=parts.model, optimizer=parts.optimizer, scheduler=parts.scheduler, scaler=parts.scaler
            )
            ok = True
        except CheckpointError:
            ok, resumed = False, None
    if not ok and not (_equal(_state_of(parts), before) and _equal(_random_state(), rng_before)):
        case.violation("half-applied resume")
    same = resumed is not None and _equal(_state_of(parts), case.template.steps.get(resumed.step))
    if ok and resumed is not None and not same and not case.altered:
        case.violation(f"resume succeeded with other data (step {resumed.step})")
    if ok and resumed is None:
        case.outcome("resume (no checkpoint found)", True, True)
    else:
        case.outcome("resume", ok, same)
    with case.timed("inspect"):
        try:
            summarize(folder)
            ok = True
        except CheckpointError:
            ok = False
    if _check_cli(case, "inspect", ["ckpt", "inspect", str(folder)]) != ok:
        case.violation("inspect: library and CLI disagree")
    case.outcome("inspect", ok, ok)


# ---------------------------------------------------------------- the classes

BYTE_DAMAGE = ["truncate", "flip", "flip header", "splice", "length", "insert", "delete", "zero"]


def malformed_weights(case: Case, kind: str, draw: Callable[[Any], Any]) -> Callable[[], None]:
    name, kind = kind.split(": ")
    path = case.where / name
    data = path.read_bytes()
    other = (case.template.root / ("w.pt" if name == "w.safetensors" else "w.safetensors")).read_bytes()
    if kind in BYTE_DAMAGE:
        damaged = _damage_bytes(data, kind, draw, other)
    elif kind == "runs code":
        damaged = _payload_file(case.marker)
    elif name == "w.pt":  # "well-formed"
        damaged, case.altered = _rezip_with_damaged_pickle(data, draw), True
    else:
        damaged, case.altered = _edit_header_without_checksum(data, draw), True
    path.write_bytes(damaged)
    return lambda: check_weights_file(case, path)


def damaged_folder(case: Case, kind: str, draw: Callable[[Any], Any]) -> Callable[[], None]:
    run = case.where / "run"
    step = draw(st.sampled_from(["step-00000002", "step-00000001"]))  # mostly the latest
    target = run / step / draw(st.sampled_from(["state.pt", "model.safetensors"]))
    if kind.startswith("bytes"):
        target = run / step / kind.split(" of ")[1]
        other = (run / "step-00000001" / target.name).read_bytes()
        target.write_bytes(_damage_bytes(target.read_bytes(), draw(st.sampled_from(BYTE_DAMAGE)), draw, other))
    elif kind == "swap files within a step":
        a, b = run / step / "state.pt", run / step / "model.safetensors"
        a_bytes, b_bytes = a.read_bytes(), b.read_bytes()
        a.write_bytes(b_bytes)
        b.write_bytes(a_bytes)
    elif kind == "swap a file between steps":
        other = run / ("step-00000001" if step == "step-00000002" else "step-00000002") / target.name
        mine, theirs = target.read_bytes(), other.read_bytes()
        target.write_bytes(theirs)
        other.write_bytes(mine)
    elif kind == "delete a file":
        target.unlink()
    elif kind == "rename folders":
        new = draw(st.sampled_from(["swap", "step-00000003", "step-00000001x", "step-1", ".step-00000002", "junk"]))
        if new == "swap":
            (run / "step-00000001").rename(run / "tmp")
            (run / "step-00000002").rename(run / "step-00000001")
            (run / "tmp").rename(run / "step-00000002")
        elif not (run / new).exists():
            (run / step).rename(run / new)
    elif kind == "state runs code":
        (run / step / "state.pt").write_bytes(_payload_file(case.marker))
    else:  # "re-zipped damaged state pickle"
        target = run / step / "state.pt"
        target.write_bytes(_rezip_with_damaged_pickle(target.read_bytes(), draw))
        case.altered = True
    return lambda: check_folder(case, run)


HOSTILE_NAMES = [
    "step-99999999999999999999",
    "step-99999999",
    "step-0000000٥",
    "step-00000009.bak",
    "step--0000001",
    "step-00000003",
    ".step-00000003.prev-host-1-abc",
    ".step-00000002.tmp-host-1-abc",
]


CONTENTS = ["copy of step 2", "copy of step 1", "empty folder", "file", "symlink", "junk"]


def hostile_names(case: Case, kind: str, draw: Callable[[Any], Any]) -> Callable[[], None]:
    run = case.where / "run"
    others = draw(st.lists(st.tuples(st.sampled_from(HOSTILE_NAMES), st.sampled_from(CONTENTS)), max_size=3))
    for name, content in [(kind, draw(st.sampled_from(CONTENTS))), *others]:
        if not (os.path.lexists(run / name)):
            _add_entry(case, run, run / name, content)
    return lambda: check_folder(case, run)


def _add_entry(case: Case, run: Path, entry: Path, content: str) -> None:
    COUNTS[case.cls][f"content: {content}"] += 1
    if content.startswith("copy"):
        shutil.copytree(run / f"step-0000000{content[-1]}", entry)
    elif content == "empty folder":
        entry.mkdir()
    elif content == "file":
        entry.write_bytes(b"not a checkpoint")
    elif content == "symlink":
        entry.symlink_to(run / "step-00000001", target_is_directory=True)
    else:
        entry.mkdir()
        (entry / "model.safetensors").write_bytes(b"junk")
        (entry / "state.pt").write_bytes(b"junk")


KINDS = {
    CLASSES[0]: [
        f"{name}: {kind}" for name in ("w.safetensors", "w.pt") for kind in [*BYTE_DAMAGE, "well-formed", "runs code"]
    ],
    CLASSES[1]: [
        "bytes of state.pt",
        "bytes of model.safetensors",
        "swap files within a step",
        "swap a file between steps",
        "delete a file",
        "rename folders",
        "state runs code",
        "re-zipped damaged state pickle",
    ],
    CLASSES[2]: HOSTILE_NAMES,
}
DAMAGE = {CLASSES[0]: malformed_weights, CLASSES[1]: damaged_folder, CLASSES[2]: hostile_names}
COMBINATIONS = [(cls, kind) for cls in CLASSES for kind in KINDS[cls]]


@pytest.mark.parametrize(("cls", "kind"), COMBINATIONS)
@settings(
    max_examples=max(1, CASES // len(COMBINATIONS)),
    deadline=None,
    derandomize=not LONG,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(data=st.data())
def test_damaged_checkpoints_load_right_or_are_refused(
    template: Template, cls: str, kind: str, data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as root:
        where = Path(root)
        shutil.copytree(template.root / "run", where / "run", symlinks=True)
        for name in ("w.safetensors", "w.pt"):
            shutil.copy(template.root / name, where / name)
        (where / "out").mkdir()
        case = Case(template, where, cls)
        with _quiet():
            check = DAMAGE[cls](case, kind, data.draw)
            COUNTS[cls]["cases"] += 1
            COUNTS[cls][f"damage: {kind}"] += 1
            disk = _disk(where)
            check()
        if _disk(where) != disk:
            case.violation("checkpoint lost or changed on disk by a read")
        if case.marker.exists():
            case.violation("code run from a file")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
