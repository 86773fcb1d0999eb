"""Read torch files (``torch.save``'s zip of pickle and storage records) without ever running code from them.

``torch.load(weights_only=True)`` runs no code from the file, but it trusts the archive: a missing
record is a raw ``RuntimeError``, and its allowed globals include ``bytearray``, so a 30-byte pickle
can ask for terabytes. :func:`check_torch_file` looks first, with only :mod:`zipfile` and an
unpickler that builds no tensor (the zip's layout and names, the pickle's globals against a stricter
list than torch's, every storage record present and of its declared size, every view inside its
storage, and, unless only the structure is read, every record's CRC-32); then
:func:`load_torch_file` hands the same open file to ``torch.load``. The rules are listed in
docs/checkpoints.md ("Safe loading"). Legacy (pre-1.6, non-zip) files cannot be checked and load
only when trusted (``allow_unsafe_pickle=True``).
"""

from __future__ import annotations

import io
import math
import os
import pickle
import pkgutil
import re
import struct
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, NoReturn

import torch

from multigpu.checkpoint.file_kinds import ZIP_LOCAL_SIGNATURE, kind_of, open_regular, refuse
from multigpu.errors import CheckpointError

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zip local file header, 30 bytes

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

ALLOWED_GLOBALS = (
    _PLAIN_GLOBALS
    | {f"torch {cls.__name__}" for cls in torch._storage_classes}  # FloatStorage, ...
    | {f"torch {name}" for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}
)


def check_torch_file(f: BinaryIO, path: str | os.PathLike[str], *, verify_records: bool = True) -> None:
    """Refuse a torch file that ``torch.load(weights_only=True)`` should not be given.

    Args:
        f: the open file (named ``path`` in messages); the caller hands this same object to
            ``torch.load``, so what is checked is what is loaded even if ``path`` is replaced meanwhile.
        verify_records: also check every record's CRC-32 (a damaged tensor); else only ``data.pkl`` is read.

    Raises:
        CheckpointError: the file is not a well-formed torch zip, or its pickle wants globals
            beyond plain tensors and containers; the message names the file and the problem.
    """
    f.seek(0)
    if f.read(4) != ZIP_LOCAL_SIGNATURE:
        _fail(path, _not_a_zip_at_0(f, path))
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
            _check_storages(f, path, data, {i.filename: i.file_size for i in infos}, root)
            damaged = archive.testzip() if verify_records else None  # reads every record, checking its CRC-32
            if damaged is not None:
                refuse(path, f" is damaged: record {damaged!r} does not match its CRC-32")
    except CheckpointError:
        raise
    except Exception as exc:  # zipfile raises many types for broken archives
        _fail(path, f"it is not a readable zip archive ({type(exc).__name__}: {str(exc)[:200]})")


def _not_a_zip_at_0(f: BinaryIO, path: str | os.PathLike[str]) -> str:
    # What the file is instead, by its structure (file_kinds), so the message names the right fix.
    try:
        kind = kind_of(f, path)
    except CheckpointError:
        return "it is neither a zip archive (torch.save since 1.6) nor a legacy torch pickle"
    if kind == "legacy torch":
        return (
            "it is a legacy (pre-1.6) torch file, which cannot be checked before loading. If you trust "
            "it, load it with allow_unsafe_pickle=True (CLI: --allow-unsafe-pickle) and re-save it"
        )
    if kind == "torch zip":
        return "the archive does not start at byte 0 (data was prepended to it)"
    return "it is a safetensors file (read it with multigpu.load, or give the torch file it should be)"


def _check_storages(f: BinaryIO, path: str | os.PathLike[str], data: bytes, sizes: dict[str, int], root: str) -> None:
    # The pickle is read with only the globals plain tensors and containers need (the first other one
    # stops it before it is built; torch's own lister then names every global the file wants), into
    # stand-ins for its storages and tensors; then what it declares (each storage's dtype and length,
    # each tensor's place in its storage) is held against the zip directory's record sizes:
    # torch.load checks these only when it reads the data.
    declared = _Declared(data, path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TypedStorage classes warn that they are deprecated
            declared.load()
    except _Unsafe as exc:
        f.seek(0)
        raise CheckpointError(unsafe_message(path, sorted({exc.args[0], *_pickled_globals(f)}))) from None
    except CheckpointError:
        raise
    except Exception as exc:  # a damaged pickle raises anything: EOFError, UnpicklingError, TypeError, ...
        _fail(path, f"its data.pkl is not a valid pickle ({type(exc).__name__}: {str(exc)[:200]})")
    for key, (dtype, numel) in declared.storages.items():
        record = f"{root}/data/{key}"
        if record not in sizes:
            _damaged(path, f"the record {record!r} of a storage its pickle declares is missing")
        if sizes[record] != numel * dtype.itemsize:
            _damaged(
                path,
                f"the record {record!r} holds {sizes[record]} bytes but its storage declares {numel} elements "
                f"of {dtype} ({numel * dtype.itemsize} bytes)",
            )
    for key, itemsize, offset, shape, stride in declared.views:
        dtype, numel = declared.storages[key]
        if any(not isinstance(n, int) or n < 0 for n in (offset, *shape, *stride)) or len(shape) != len(stride):
            _damaged(path, f"a tensor of storage {key!r} has offset {offset}, shape {shape} and stride {stride}")
        if math.prod(shape) == 0:
            continue
        end = (offset + sum((n - 1) * st for n, st in zip(shape, stride)) + 1) * itemsize
        if end > numel * dtype.itemsize:
            _damaged(
                path,
                f"a tensor of shape {list(shape)} reaches byte {end} of storage {key!r}, which holds "
                f"{numel * dtype.itemsize} bytes",
            )


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


class _Unsafe(Exception):
    """A global beyond plain tensors and containers (its ``module.name``): the pickle is not read further."""


class _Declared(pickle.Unpickler):
    """Unpickles a checked ``data.pkl`` into stand-ins: the storages it declares, the views it takes; no tensor."""

    def __init__(self, data: bytes, path: str | os.PathLike[str]) -> None:
        super().__init__(io.BytesIO(data))
        self.path = path
        self.storages: dict[str, tuple[torch.dtype, int]] = {}  # key -> (dtype, number of elements)
        self.views: list[tuple[str, int, int, tuple[Any, ...], tuple[Any, ...]]] = []  # key, itemsize, offset, ...

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            _damaged(self.path, f"its pickle refers to {str(pid)[:80]}, not to a storage record")
        _, storage_type, key, _, numel = pid
        dtype = storage_type.dtype if isinstance(storage_type, _StorageType) else None
        if not isinstance(dtype, torch.dtype) or not isinstance(numel, int) or numel < 0:
            _damaged(self.path, f"its pickle declares a storage {str(pid)[:80]}")
        self.storages[str(key)] = (dtype, numel)
        return str(key)

    def find_class(self, module: str, name: str) -> Any:
        if f"{module} {name}" not in ALLOWED_GLOBALS:  # also reached by INST, OBJ and EXT opcodes
            raise _Unsafe(f"{module}.{name}")
        if name.endswith("Storage"):  # a stand-in, not the class: a pickle may not call it (allocate)
            return _StorageType(torch.uint8 if name == "UntypedStorage" else getattr(torch, name).dtype)
        if name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3"):
            return self._view
        if name.startswith("_rebuild_parameter"):
            return lambda data, *_: data
        if name == "_rebuild_from_type_v2":
            return lambda func, _type, args, _state: func(*args)
        return super().find_class(module, name)

    def _view(self, key: Any, offset: Any, shape: Any, stride: Any, *rest: Any) -> None:
        if key not in self.storages:
            _damaged(self.path, "its pickle builds a tensor on something other than a storage record")
        dtype = rest[2] if len(rest) >= 3 and isinstance(rest[2], torch.dtype) else self.storages[key][0]
        self.views.append((key, dtype.itemsize, offset, tuple(shape), tuple(stride)))


def _damaged(path: str | os.PathLike[str], what: str) -> NoReturn:
    refuse(path, f" is a damaged torch file: {what}")


def unsafe_message(path: str | os.PathLike[str], wanted: list[str]) -> str:
    shown = ", ".join(repr(w)[1:-1] for w in wanted[:5]) + (" ..." if len(wanted) > 5 else "")
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
        if len(raw) != _LOCAL_HEADER.size or raw[:4] != ZIP_LOCAL_SIGNATURE:
            _fail(path, f"member {info.filename[:200]!r} has no local header at byte {info.header_offset}")
        fields = _LOCAL_HEADER.unpack(raw)
        data_end = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1] + info.compress_size
        limit = ordered[index + 1].header_offset if index + 1 < len(ordered) else end_of_members
        if data_end > limit or data_end > size:
            _fail(path, f"member {info.filename[:200]!r} overlaps the next entry or runs past the end of the file")


def _fail(path: str | os.PathLike[str], what: str) -> NoReturn:
    refuse(path, f" is not a valid torch checkpoint: {what}")


def load_torch_file(
    path: str | os.PathLike[str], *, allow_unsafe_pickle: bool = False, map_location: Any = "cpu"
) -> Any:
    """``torch.load`` that never unpickles arbitrary objects unless explicitly told to.

    The file is checked first (:func:`check_torch_file`) and read
    through a file object, so its name never changes how it is read.

    Args:
        path: a file written by ``torch.save``.
        allow_unsafe_pickle: load files that need arbitrary unpickling. Only for files you
            trust: unpickling can run any code the file's author chose.
        map_location: passed to ``torch.load``; ``"meta"`` reads the structure without the data.

    Raises:
        CheckpointError: the file is damaged, needs arbitrary unpickling and ``allow_unsafe_pickle``
            is off, or it is on and the file needs a class that cannot be imported here.
    """
    try:
        with open_regular(path) as f:
            if not allow_unsafe_pickle:
                check_torch_file(f, path, verify_records=map_location != "meta")
                f.seek(0)
            return torch.load(f, map_location=map_location, weights_only=not allow_unsafe_pickle)
    except pickle.UnpicklingError as exc:
        if allow_unsafe_pickle:
            raise CheckpointError(f"{str(path)!r} is not a readable torch file: {exc}") from exc
        raise CheckpointError(_unsafe_message(path, exc)) from exc
    except (CheckpointError, OSError):
        raise
    except (ImportError, AttributeError) as exc:  # unpickling's find_class: no such module, or no such name
        missing = [name for name in _pickled_globals(path) if not _importable(name)] if allow_unsafe_pickle else []
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise CheckpointError(
                f"cannot load {str(path)!r}: its pickle needs {shown}, which cannot be imported here ({exc}). "
                "Run where the code that defined it is importable: from your project's folder, or with that "
                "folder on PYTHONPATH (e.g. PYTHONPATH=/path/to/project). Better, once it loads, re-save the "
                "weights as plain tensors (multigpu ckpt convert), which need no code to read."
            ) from exc
        _damaged(path, f"{type(exc).__name__}: {str(exc)[:300]}")
    except Exception as exc:  # torch reports damaged records as RuntimeError, AssertionError, ...
        _damaged(path, f"{type(exc).__name__}: {str(exc)[:300]}")


def _pickled_globals(file: str | os.PathLike[str] | BinaryIO) -> list[str]:
    """The ``module.name`` globals a torch file's pickle needs beyond torch's weights-only set (read, not run)."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(file if hasattr(file, "read") else str(file)))
    except Exception:  # not a zip-format torch file, or a torch without this helper
        return []


def _importable(qualified: str) -> bool:
    """Whether ``a.b.C`` resolves here: the longest importable module prefix, then attributes (as unpickling does)."""
    try:
        pkgutil.resolve_name(qualified)
    except Exception:  # no such module or attribute, or a module that fails to import
        return False
    return True


def _unsafe_message(path: str | os.PathLike[str], exc: BaseException) -> str:
    wanted = _pickled_globals(path)
    if wanted:
        return unsafe_message(path, wanted)
    # No global beyond plain data: an opcode torch's weights-only reader does not read (an int of
    # more than 255 bytes, ...), which torch.save never writes for a state dict.
    found = re.search(r"WeightsUnpickler error:\s*(.+)", str(exc))
    return (
        f"{str(Path(path))!r} is a damaged torch file: its pickle holds what torch's weights-only reader does "
        f"not read ({found.group(1).strip()[:200] if found else type(exc).__name__}). Use another checkpoint, "
        "or re-save this one from its source."
    )
