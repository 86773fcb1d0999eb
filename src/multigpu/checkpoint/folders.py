"""The step-N folders of a Checkpointer: their names, and the manifest of a sharded one.

A checkpoint folder is named exactly ``f"step-{step:08d}"`` (ASCII digits, the step at most
:data:`MAX_STEP`); a step being replaced waits under a hidden aside name
(:func:`~multigpu.checkpoint.atomic.install_folder`). Which folders are checkpoints, the storages say
(:mod:`storages`). ``manifest.json`` marks a sharded folder and records every DCP file's size and
CRC-32; ``state.pt`` records its digest. Layout and rules: docs/checkpoints.md.
"""

from __future__ import annotations

import json
import os
import re
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

from multigpu.checkpoint.atomic import atomic_write_file
from multigpu.checkpoint.file_kinds import entry_is, open_regular, refuse
from multigpu.errors import CheckpointError, ConfigError

STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
METADATA_FILE = ".metadata"  # DCP's name for its index
MAX_WORLD_SIZE = 1 << 24
FORMAT = "dcp"
MANIFEST_VERSION = 1
_MAX_MANIFEST_BYTES = 16 << 20
_CHUNK = 4 << 20
_SHARD_NAME = re.compile(r"__([0-9]{1,8})_[0-9]{1,8}\.distcp", re.ASCII)
DATA_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}", re.ASCII)  # a plain name inside the folder
FIX = (
    "Resume from another step (Checkpointer.resume(path=...)), or move this folder away so that the "
    "previous step is the latest."
)

MAX_STEP = 2**63 - 1  # int64, what loggers and torch store steps as
PREFIX = "step-"
_STEP = re.compile(r"step-([0-9]{8,19})", re.ASCII)
_ASIDE = re.compile(r"\.(step-[0-9]{8,19})\.prev-.+", re.ASCII)


def folder_name(step: int) -> str:
    """The folder name of ``step``.

    Example:
        >>> folder_name(42), folder_name(123456789)
        ('step-00000042', 'step-123456789')
    """
    return f"{PREFIX}{step:08d}"


def parse_step(name: str) -> int | None:
    """The step a folder name stands for, or ``None`` if it is not exactly a name we write.

    Example:
        >>> parse_step("step-00000042"), parse_step("step-42"), parse_step("step-99999999999999999999")
        (42, None, None)
    """
    match = _STEP.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step <= MAX_STEP and folder_name(step) == name else None


def parse_aside(name: str) -> int | None:
    """The step of an aside folder name, or ``None``."""
    match = _ASIDE.fullmatch(name)
    return parse_step(match.group(1)) if match else None


def check_count(value: object, name: str, *, maximum: int = MAX_STEP) -> int:
    """``value`` if it is an int in ``[0, maximum]`` (a step, an epoch); else :class:`ConfigError`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be an int (got {type(value).__name__}).")
    if not 0 <= value <= maximum:
        raise ConfigError(f"{name}={value} must be between 0 and {maximum}.")
    return value


def regular_files(folder: Path, names: tuple[str, ...]) -> bool:
    try:
        return all(stat.S_ISREG(os.lstat(folder / name).st_mode) for name in names)
    except OSError:
        return False


# --- manifest.json ---


@dataclass(frozen=True, kw_only=True)
class FileRecord:
    """What the manifest records of one DCP file."""

    nbytes: int
    crc32: int


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A checked ``manifest.json``."""

    step: int
    world_size: int
    files: dict[str, FileRecord]

    @property
    def digest(self) -> str:
        """The checksum ``state.pt`` records as its ``model_checksum``."""
        return files_digest(self.files)


def is_sharded_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a manifest, i.e. is (meant to be) a sharded checkpoint.

    Any entry of that name counts (a pipe, a folder, a dangling link): reading it then says what is wrong.
    """
    return os.path.lexists(folder / MANIFEST_FILE)


def files_digest(files: dict[str, FileRecord]) -> str:
    """One CRC-32 over every file's name, size and CRC-32."""
    table = json.dumps({name: [r.nbytes, r.crc32] for name, r in sorted(files.items())}, separators=(",", ":"))
    return f"dcp:crc32:{zlib.crc32(table.encode()):08x}"


def file_crc32(path: Path) -> FileRecord:
    """Size and CRC-32 of the file at ``path``, read in 4 MiB pieces."""
    crc, nbytes = 0, 0
    with open_regular(path) as f:
        while piece := f.read(_CHUNK):
            crc = zlib.crc32(piece, crc)
            nbytes += len(piece)
    return FileRecord(nbytes=nbytes, crc32=crc)


def own_files(folder: Path, rank: int) -> dict[str, FileRecord]:
    """The DCP files rank ``rank`` wrote into ``folder`` (``__<rank>_*.distcp``; rank 0 also ``.metadata``)."""
    names = [p.name for p in folder.iterdir() if (m := _SHARD_NAME.fullmatch(p.name)) and int(m.group(1)) == rank]
    if rank == 0 and (folder / METADATA_FILE).is_file():
        names.append(METADATA_FILE)
    return {name: file_crc32(folder / name) for name in sorted(names)}


def write_manifest(folder: Path, *, step: int, world_size: int, files: dict[str, FileRecord]) -> str:
    """Write ``manifest.json`` atomically into ``folder``; returns its digest."""
    body = {
        "format": FORMAT,
        "version": MANIFEST_VERSION,
        "step": step,
        "world_size": world_size,
        "files": {name: {"bytes": r.nbytes, "crc32": f"{r.crc32:08x}"} for name, r in sorted(files.items())},
    }
    text = json.dumps(body, indent=1).encode()

    def write(f: BinaryIO) -> None:
        f.write(text)

    atomic_write_file(folder / MANIFEST_FILE, write)
    return files_digest(files)


def read_manifest(folder: Path) -> Manifest:
    """The checked manifest of the sharded checkpoint ``folder``.

    Raises:
        CheckpointError: it is missing, too large, not JSON, or a field is wrong.
    """
    path = folder / MANIFEST_FILE
    try:
        with open_regular(path) as f:
            raw = f.read(_MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"cannot read {str(path)!r}: {exc.strerror or exc}. {FIX}") from exc
    if len(raw) > _MAX_MANIFEST_BYTES:
        bad(path, "its size", f"more than {_MAX_MANIFEST_BYTES} bytes", "a small JSON file")
    try:
        # UTF-8 as written (json.loads would also take UTF-16 and -32); ValueError covers a number of
        # more digits than Python converts (4300), RecursionError a deep nesting.
        body = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{str(path)!r} is not valid JSON ({exc}); the checkpoint is damaged. {FIX}") from exc
    if not isinstance(body, dict):
        bad(path, "the manifest", body, "a JSON object")
    if body.get("format") != FORMAT or body.get("version") != MANIFEST_VERSION:
        bad(path, "'format'/'version'", (body.get("format"), body.get("version")), f"({FORMAT!r}, {MANIFEST_VERSION})")
    step, world = body.get("step"), body.get("world_size")
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        bad(path, "'step'", step, f"an int from 0 to {MAX_STEP}")
    if type(world) is not int or not 1 <= world <= MAX_WORLD_SIZE:
        bad(path, "'world_size'", world, f"an int from 1 to {MAX_WORLD_SIZE}")
    entries = body.get("files")
    if not isinstance(entries, dict) or METADATA_FILE not in entries:
        bad(path, "'files'", entries, f"an object naming every DCP file, {METADATA_FILE!r} included")
    files = {}
    for name, entry in entries.items():
        if name != METADATA_FILE and not DATA_NAME.fullmatch(name):
            bad(path, "a file name", name, "a plain name inside the folder")
        nbytes = entry.get("bytes") if isinstance(entry, dict) else None
        crc = entry.get("crc32") if isinstance(entry, dict) else None
        if type(nbytes) is not int or nbytes < 0 or not (isinstance(crc, str) and re.fullmatch(r"[0-9a-f]{8}", crc)):
            bad(path, f"the entry of {name!r}", entry, '{"bytes": <int>, "crc32": "<8 hex digits>"}')
        files[name] = FileRecord(nbytes=nbytes, crc32=int(crc, 16))
    return Manifest(step=step, world_size=world, files=files)


def recorded_step(folder: Path) -> int | None:
    """The step the manifest of ``folder`` records, or ``None`` if it has no readable manifest."""
    try:
        return read_manifest(folder).step
    except (CheckpointError, OSError):
        return None


def bad(path: Path, entry: str, found: Any, expected: str) -> NoReturn:
    refuse(path, entry_is(entry, found, expected) + ". The checkpoint is damaged", FIX)
