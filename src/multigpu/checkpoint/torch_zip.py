"""Check a torch file before ``torch.load`` reads it: zip layout, record names, and the pickle's globals.

``torch.save`` writes a zip archive of uncompressed records under one folder: ``data.pkl``
(the object, as a pickle), ``version`` (or ``.data/version``), and one ``data/<key>`` record per
storage. ``torch.load(weights_only=True)`` never runs code from the file, but it still trusts
the archive: a missing record is a raw ``RuntimeError``, and its allowed globals include
``bytearray``, so a 30-byte pickle can ask for terabytes. Here, with only :mod:`zipfile` and
:mod:`pickletools` (neither executes anything):

* the archive must be a zip starting at byte 0, every member stored uncompressed, inside the file,
  not overlapping another, under one root folder, with a plain relative name (no ``..``, no
  absolute path, no backslash) that appears once;
* ``data.pkl`` and ``version`` must be there;
* the pickle may name only the globals that plain tensors and containers need.

Legacy (pre-1.6, non-zip) torch files cannot be checked like this and are loaded only when the
caller trusts the file (``allow_unsafe_pickle=True``).
"""

from __future__ import annotations

import io
import os
import pickletools
import struct
import zipfile
from pathlib import Path, PurePosixPath
from typing import BinaryIO, NoReturn

import torch

from multigpu.checkpoint.integrity import verify_zip_records
from multigpu.errors import CheckpointError

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zip local file header, 30 bytes
_LOCAL_SIGNATURE = b"PK\x03\x04"

# What torch.save writes for state dicts, optimizer states and plain containers; nothing that
# allocates from a number in the file (bytearray) or builds tensors other than dense ones.
_PLAIN_GLOBALS = frozenset(
    {
        "collections OrderedDict",
        "torch._utils _rebuild_tensor_v2",
        "torch._utils _rebuild_tensor_v3",
        "torch._utils _rebuild_parameter",
        "torch._utils _rebuild_parameter_with_state",
        "torch._tensor _rebuild_from_type_v2",
        "torch.storage UntypedStorage",
        "torch Size",
        "torch device",
        "builtins set",
        "builtins complex",
        "_codecs encode",
    }
)


def _tensor_globals() -> frozenset[str]:
    names = {f"torch {cls.__name__}" for cls in torch._storage_classes}  # FloatStorage, ...
    names |= {f"torch {name}" for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}
    return frozenset(names)


ALLOWED_GLOBALS = _PLAIN_GLOBALS | _tensor_globals()


def is_zip(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` starts like a zip archive (torch's format since 1.6)."""
    with open(path, "rb") as f:
        return f.read(4) == _LOCAL_SIGNATURE


def check_torch_file(f: BinaryIO, path: str | os.PathLike[str], *, verify_records: bool = True) -> None:
    """Refuse a torch file that ``torch.load(weights_only=True)`` should not be given.

    Args:
        f: the file, open for reading; the caller hands this same object to ``torch.load``, so
            what is checked is what is loaded even if ``path`` is replaced meanwhile.
        path: its name, for messages.
        verify_records: also read every record to check its CRC-32 (a damaged tensor); without
            it only ``data.pkl`` is read (and checked).

    Raises:
        CheckpointError: the file is not a well-formed torch zip, or its pickle wants globals
            beyond plain tensors and containers; the message names the file and the problem.
    """
    f.seek(0)
    if f.read(4) != _LOCAL_SIGNATURE:
        _fail(
            path,
            "it is a legacy (pre-1.6) or non-zip torch file, which cannot be checked before loading. "
            "If you trust it, load it with allow_unsafe_pickle=True (CLI: --allow-unsafe-pickle) "
            "and re-save it",
        )
    size = os.fstat(f.fileno()).st_size
    try:
        with zipfile.ZipFile(f) as archive:  # given a file object, closing the archive leaves it open
            infos = archive.infolist()
            root = _check_names(path, [i.filename for i in infos])
            _check_layout(path, archive, infos, size)
            pickle_name = f"{root}/data.pkl"
            names = {i.filename for i in infos}
            if pickle_name not in names:
                _fail(path, f"the archive has no {pickle_name!r} record")
            if f"{root}/version" not in names and f"{root}/.data/version" not in names:
                _fail(path, f"the archive has no {root + '/version'!r} record")
            data = archive.read(pickle_name)  # zipfile checks its CRC-32
            if verify_records:
                verify_zip_records(path, archive)
    except CheckpointError:
        raise
    except Exception as exc:  # zipfile raises many types for broken archives
        _fail(path, f"it is not a readable zip archive ({type(exc).__name__}: {str(exc)[:200]})")
    unsafe = pickle_globals(data, path) - ALLOWED_GLOBALS
    if unsafe:
        raise CheckpointError(unsafe_message(path, sorted(unsafe)))


def pickle_globals(data: bytes, path: str | os.PathLike[str]) -> set[str]:
    """The ``module name`` globals a pickle refers to, read without unpickling it."""
    found: set[str] = set()
    try:
        for opcode, arg, _ in pickletools.genops(io.BytesIO(data)):
            if opcode.name == "GLOBAL":
                found.add(str(arg))
            elif opcode.name in ("STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4"):
                found.add(f"<{opcode.name} opcode>")  # torch's weights-only unpickler refuses these anyway
    except Exception as exc:
        _fail(path, f"its data.pkl is not a valid pickle ({type(exc).__name__}: {str(exc)[:200]})")
    return found


def unsafe_message(path: str | os.PathLike[str], wanted: list[str]) -> str:
    shown = ", ".join(repr(w.replace(" ", "."))[1:-1] for w in wanted[:5]) + (" ..." if len(wanted) > 5 else "")
    return (
        f"refusing to load {str(Path(path))!r}: it needs arbitrary unpickling ({shown}); unpickling "
        "such objects can run code the file's author chose or allocate memory without bound. If you "
        "trust this file, pass allow_unsafe_pickle=True (CLI: --allow-unsafe-pickle); better, re-save "
        "it as plain tensors (multigpu ckpt convert)."
    )


def _check_names(path: str | os.PathLike[str], names: list[str]) -> str:
    if not names:
        _fail(path, "the archive is empty")
    seen: set[str] = set()
    roots: set[str] = set()
    for name in names:
        parts = PurePosixPath(name).parts
        if (
            name.startswith("/")
            or "\\" in name
            or "\x00" in name
            or ".." in parts
            or len(parts) < 2
            or (parts and parts[0].endswith(":"))
        ):
            _fail(path, f"the archive has a member named {name[:200]!r}; expected names like 'archive/data.pkl'")
        if name in seen:
            _fail(path, f"the archive holds {name[:200]!r} twice")
        seen.add(name)
        roots.add(parts[0])
    if len(roots) != 1:
        _fail(path, f"the archive's members lie under {len(roots)} folders ({sorted(roots)[:4]}); expected one")
    return roots.pop()


def _check_layout(
    path: str | os.PathLike[str], archive: zipfile.ZipFile, infos: list[zipfile.ZipInfo], size: int
) -> None:
    # Members must be stored as they are, and lie one after the other inside the file: a member
    # that overlaps another or extends past the end is a zip bomb or a damaged archive.
    end_of_members = archive.start_dir
    if infos and min(i.header_offset for i in infos) != 0:
        _fail(path, "the archive does not start at byte 0 (data was prepended to it)")
    ordered = sorted(infos, key=lambda i: i.header_offset)
    fp = archive.fp
    if fp is None:
        _fail(path, "the archive could not be read")
    for index, info in enumerate(ordered):
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size or info.flag_bits & 1:
            _fail(path, f"member {info.filename[:200]!r} is compressed or encrypted; torch.save stores records as is")
        fp.seek(info.header_offset)
        raw = fp.read(_LOCAL_HEADER.size)
        if len(raw) != _LOCAL_HEADER.size or raw[:4] != _LOCAL_SIGNATURE:
            _fail(path, f"member {info.filename[:200]!r} has no local header at byte {info.header_offset}")
        fields = _LOCAL_HEADER.unpack(raw)
        data_end = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1] + info.compress_size
        limit = ordered[index + 1].header_offset if index + 1 < len(ordered) else end_of_members
        if data_end > limit or data_end > size:
            _fail(path, f"member {info.filename[:200]!r} overlaps the next entry or runs past the end of the file")


def _fail(path: str | os.PathLike[str], what: str) -> NoReturn:
    raise CheckpointError(f"{str(Path(path))!r} is not a valid torch checkpoint: {what}.")
