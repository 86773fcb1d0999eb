"""Read and write tensor files in safetensors or torch format, never executing code from a file.

A safetensors file is read from the one open file whose header was checked
(:mod:`safetensors_file`); a torch file through :mod:`torch_file`. A tensor in a torch file is a
view of a storage, so a few bytes on disk can be terabytes once copied: :func:`check_expansion`
bounds what converting a file may allocate (loading into a model is bounded by the model's shapes).
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import reprlib
import sys
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Literal

import safetensors
import safetensors.torch
import torch

from multigpu.checkpoint.atomic import atomic_write_file, atomic_write_path
from multigpu.checkpoint.file_kinds import is_zip, kind_of, open_regular
from multigpu.checkpoint.manifest import MANIFEST_FILE, PIECE, THREADS, FileRecord, check_listed, combine, file_record
from multigpu.checkpoint.safetensors_file import (
    CHECKSUM_KEY,
    DTYPES,
    Header,
    TensorEntry,
    packed,
    placeholder,
    read_header,
    read_header_from,
    stamp,
    submit_crcs,
    tensor_crcs,
    verify_header,
    verify_tensors,
)
from multigpu.checkpoint.torch_file import load_torch_file
from multigpu.core.lookup import lookup
from multigpu.errors import CheckpointError, ConfigError

Format = Literal["safetensors", "torch"]
Structure = list[tuple[str, tuple[int, ...], torch.dtype]]  # (key, shape, dtype) of each tensor
FORMATS: tuple[Format, ...] = ("safetensors", "torch")

_TORCH_SUFFIXES = {".pt", ".pth", ".bin", ".ckpt", ".tar"}
_SUFFIX: dict[Format, str] = {"torch": ".pt", "safetensors": ".safetensors"}
_PLAIN_DTYPES = frozenset(DTYPES.values()) | {torch.float64, torch.complex128, torch.int16}
_SAFETENSORS_DTYPES = frozenset(DTYPES.values())  # what our reader takes of a safetensors header
_ALIASES_KEY = "multigpu.aliases"
# Keys under which training scripts commonly nest the model's state dict in a torch file.
_NESTED_MODEL_KEYS = ("state_dict", "model_state_dict", "model", "module")
_MAX_NESTING = 4
DEFAULT_MAX_EXPANSION = 4.0  # contiguous bytes per byte on disk, for `ckpt convert`
_SLACK = 1 << 20  # small files (headers, empty tensors) may expand by up to 1 MiB regardless


def format_for(path: str | os.PathLike[str], format: Format | None = None) -> Format:
    """The format to write ``path`` in: ``format`` if given, else by suffix (safetensors by default).

    A ``.safetensors`` name in torch format, or a torch suffix in safetensors format, is refused:
    other tools pick the reader by the suffix and would fail on the file.

    Example:
        >>> format_for("net.pt"), format_for("net.safetensors"), format_for("net")
        ('torch', 'safetensors', 'safetensors')
    """
    suffix = Path(path).suffix
    by_suffix: Format = "torch" if suffix in _TORCH_SUFFIXES else "safetensors"
    if format is None:
        return by_suffix
    lookup(
        dict.fromkeys(FORMATS), format, "format={value!r} is not one of {choices}; pick one of them.", choices=FORMATS
    )
    if (format == "torch" and suffix == ".safetensors") or (format == "safetensors" and suffix in _TORCH_SUFFIXES):
        raise ConfigError(
            f"format={format!r} does not match the name {str(path)!r}: tools that read by suffix would "
            f"expect {by_suffix}. Name the file {Path(path).with_suffix(_SUFFIX[format]).name!r}, or drop format=."
        )
    return format


def detect_format(path: str | os.PathLike[str]) -> Format:
    """The format of an existing file, from its structure (the suffix may lie; see :mod:`file_kinds`).

    Raises:
        CheckpointError: the file is neither a safetensors nor a torch file.
    """
    with open_regular(path) as f:
        return "safetensors" if kind_of(f, path) == "safetensors" else "torch"


def read_tensors(
    path: str | os.PathLike[str], *, allow_unsafe_pickle: bool = False
) -> tuple[OrderedDict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a weights file, by key, and its metadata (safetensors header; empty for torch).

    A file a step folder's manifest lists is checked against it first (:func:`~multigpu.checkpoint.manifest.check_listed`).

    A torch file may hold the tensors directly or nested under one of ``state_dict``,
    ``model_state_dict``, ``model``, ``module``. Every tensor is a dense CPU tensor.

    Raises:
        CheckpointError: the file is damaged, of another kind, or holds something else.
    """
    with reading_file(path):
        if os.path.lexists(Path(path).parent / MANIFEST_FILE):  # a file of a step folder: its manifest checks it
            check_listed(Path(path))
        if detect_format(path) == "safetensors":
            return _read_safetensors(path)
        obj = load_torch_file(path, allow_unsafe_pickle=allow_unsafe_pickle)
        return tensors_of(obj, path), {}


@contextlib.contextmanager
def reading_file(path: str | os.PathLike[str]) -> Iterator[None]:
    """An ``OSError`` reading ``path`` (a pipe, a folder, unreadable) as a :class:`CheckpointError`, except a missing file."""
    # A folder or an unreadable file is a CheckpointError; a missing file stays FileNotFoundError,
    # as Python's own readers raise (resume retries on it when another process swaps a folder).
    try:
        yield
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CheckpointError(f"cannot read {str(path)!r}: {exc.strerror or exc}.") from exc


def read_structure(
    path: str | os.PathLike[str], *, allow_unsafe_pickle: bool = False
) -> tuple[Structure, dict[str, str]]:
    """Keys, shapes and dtypes of a weights file without reading its tensor data, and its metadata."""
    with reading_file(path):
        if detect_format(path) == "safetensors":
            header = checked_safetensors_header(path)
            return [(e.key, e.shape, e.dtype) for e in header.entries], _without_aliases(header.metadata)
        obj = load_torch_file(path, allow_unsafe_pickle=allow_unsafe_pickle, map_location="meta")
        return [(k, tuple(v.shape), v.dtype) for k, v in tensors_of(obj, path, device="meta").items()], {}


def tensors_of(obj: Any, path: str | os.PathLike[str], *, device: str = "cpu") -> OrderedDict[str, torch.Tensor]:
    """The flat key -> tensor mapping inside an object loaded from a torch file."""
    for _ in range(_MAX_NESTING):
        if isinstance(obj, Mapping) and not obj:  # a model without parameters or buffers (nn.ReLU()) saves {}
            return OrderedDict()
        if isinstance(obj, Mapping) and all(isinstance(v, torch.Tensor) for v in obj.values()):
            for key, value in obj.items():
                if not isinstance(key, str):
                    raise CheckpointError(f"{str(path)!r} has a tensor under the key {key!r}; keys must be strings.")
                check_plain_tensor(value, f"{str(path)!r}: tensor {key!r}", device=device)
            return OrderedDict(obj.items())
        nested = next(
            (obj[k] for k in _NESTED_MODEL_KEYS if isinstance(obj, Mapping) and isinstance(obj.get(k), Mapping)), None
        )
        if nested is None:
            break
        obj = nested
    found = list(obj)[:8] if isinstance(obj, Mapping) else type(obj).__name__
    raise CheckpointError(
        f"{str(path)!r} holds no flat mapping of tensors (found {reprlib.repr(found)}); expected a state dict, "
        f"possibly nested under one of {list(_NESTED_MODEL_KEYS)}. Save model.state_dict()."
    )


def check_plain_tensor(value: Any, where: str, *, device: str | None = "cpu") -> torch.Tensor:
    """``value`` if it is a dense tensor of a known dtype on ``device`` (None: any that holds data, not meta);
    else CheckpointError."""
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        raise CheckpointError(f"{where} is a {type(value).__name__}; expected a plain torch.Tensor.")
    on_device = value.device.type == device if device is not None else value.device.type != "meta"
    if value.layout != torch.strided or value.is_quantized or value.is_nested or not on_device:
        raise CheckpointError(
            f"{where} is a {value.layout} tensor on {value.device}; only dense tensors are loaded "
            "(quantized, sparse, nested and meta tensors are refused)."
        )
    if value.dtype not in _PLAIN_DTYPES:
        raise CheckpointError(f"{where} has dtype {value.dtype}, which multigpu does not load.")
    return value


def write_tensors(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    format: Format | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Atomically write ``tensors`` to ``path``; returns the path.

    safetensors refuses tensors that share memory (tied weights): each alias is written once and
    recorded in the header, and :func:`read_tensors` restores it. A safetensors file carries its own
    checksum in its header (:mod:`safetensors_file`). torch format writes a plain state dict that
    ``torch.load`` + ``load_state_dict`` reads without multigpu.
    """
    chosen = format_for(path, format)
    only_tensors(tensors, chosen)
    if chosen == "torch":
        plain = OrderedDict((k, v.detach().cpu()) for k, v in tensors.items())
        return atomic_write_file(path, lambda f: torch.save(plain, f))
    write_safetensors(tensors, path, metadata=metadata, stamped=True)
    return Path(path)


def only_tensors(tensors: Mapping[str, Any], format: Format) -> None:
    """Refuse a state to write that holds something else than tensors (a module's ``get_extra_state``), or a
    tensor of a dtype the format cannot hold or multigpu does not load back (written, it failed in safetensors'
    writer with a KeyError, or was refused by the next load).

    Raises:
        ConfigError: naming the first such entry and the fix.
    """
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ConfigError(
                f"the weights to write hold {key!r}, a {type(value).__name__} (a module's get_extra_state?), not a "
                "tensor; a weights file holds tensors only: pass it through Checkpointer.save(extra=...), or leave "
                "it out of the state dict (save a dict of the tensors)"
            )
        if value.layout != torch.strided or value.is_quantized or value.is_nested or value.device.type == "meta":
            kind = "meta" if value.device.type == "meta" else "quantized" if value.is_quantized else value.layout
            raise ConfigError(
                f"the weights to write hold {key!r}, a {kind} tensor; a weights file holds dense tensors with data "
                "(the only kind multigpu loads back): save its .to_dense() (sparse), .dequantize() (quantized) or "
                "unbind() (nested), and give a meta tensor its data first (model.to_empty(device='cpu'), then load "
                "or initialise the weights)"
            )
        if value.dtype not in (_PLAIN_DTYPES if format == "torch" else _SAFETENSORS_DTYPES):
            fix = (
                "save in torch format (a .pt file, or format='torch'), which holds it"
                if value.dtype in _PLAIN_DTYPES
                else f"cast it to a dtype multigpu loads ({', '.join(sorted(str(d) for d in _PLAIN_DTYPES))})"
            )
            raise ConfigError(
                f"the weights to write hold {key!r} of dtype {value.dtype}, which a {format} file "
                f"of multigpu's cannot hold; {fix}"
            )


def write_safetensors(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    metadata: Mapping[str, str] | None,
    stamped: bool,
) -> FileRecord:
    """Atomically write ``tensors`` as a safetensors file (see :func:`write_tensors`); returns its size and CRC-32.

    The CRC-32 (a checkpoint's manifest records it) comes from the tensors in memory, taken in threads
    while the file is written. ``stamped``: the header also carries the checksum (a file on its own);
    a step folder's file does not (its manifest holds the checksum).
    """
    only_tensors(tensors, "safetensors")
    unique, aliases = _deduplicate(tensors)
    header = {str(k): str(v) for k, v in (metadata or {}).items()}
    header["format"] = "pt"
    if aliases:
        header[_ALIASES_KEY] = json.dumps(aliases)
    else:
        header.pop(_ALIASES_KEY, None)
    if stamped:
        header[CHECKSUM_KEY] = placeholder([(k, t.dtype, tuple(t.shape)) for k, t in unique.items()], header)
    written: list[FileRecord] = []
    atomic_write_path(path, lambda tmp: written.append(_save_safetensors(unique, tmp, header, stamped)))
    return written[0]


def _save_safetensors(
    tensors: dict[str, torch.Tensor], path: Path, header: dict[str, str], stamped: bool
) -> FileRecord:
    try:
        mode = _open_mode(path)
        # The tensors' CRC-32s are computed while the writer (which releases the GIL) writes them.
        with ThreadPoolExecutor(THREADS) as pool:
            pending = {key: submit_crcs(pool, tensor) for key, tensor in tensors.items()}
            safetensors.torch.save_file(tensors, str(path), header)
            crcs = tensor_crcs(pending)
        # safetensors >= 0.8 writes through a temporary file of mode 0600 that it renames into place, so the
        # file was readable by its owner alone, unlike every other file of a checkpoint
        # (https://github.com/safetensors/safetensors/issues/782): the mode open() gives, as for those; a file
        # system without modes (a CIFS mount) keeps what it has rather than failing the save
        with contextlib.suppress(OSError):
            os.chmod(path, mode)
        if stamped:
            stamp(path, crcs)
    except safetensors.SafetensorError as exc:
        # The Rust writer reports I/O failures (full disk, size limit) as text: recover the errno
        # so the caller can explain them like any other OSError.
        found = re.search(r"(?:code: |os error )(\d+)", str(exc))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from exc
    if sys.byteorder != "little":
        return file_record(path)  # the file holds the tensors' bytes swapped: read it back
    # The file is its header, then every tensor's bytes in the order of their offsets.
    written = read_header(path)
    with open(path, "rb") as f:
        start = f.read(written.data_start)
    pieces = [(zlib.crc32(start), len(start))]
    for entry in sorted(written.entries, key=lambda e: e.begin):
        lengths = [min(PIECE, entry.nbytes - at) for at in range(0, max(entry.nbytes, 1), PIECE)]
        pieces += zip(crcs[entry.key], lengths)
    return FileRecord(nbytes=written.file_size, crc32=combine(pieces))


def _open_mode(path: Path) -> int:
    """The permission bits ``open(path, "wb")`` gives a new file here (0666 less the umask), found by creating
    ``path`` so (the umask cannot be read without changing it for every thread)."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o666))
    return os.stat(path).st_mode & 0o777


def checked_safetensors_header(path: str | os.PathLike[str], f: BinaryIO | None = None) -> Header:
    """The checked header of a safetensors file that is not also a zip archive (a polyglot).

    With ``f`` (the file, open), everything is read from it.
    """
    if f is None:
        with open_regular(path) as opened:
            return checked_safetensors_header(path, opened)
    header = read_header_from(f, path)
    verify_header(path, [(e.key, e.dtype, e.shape) for e in header.entries], header.metadata)
    if is_zip(f):
        raise CheckpointError(
            f"{str(path)!r} is both a safetensors file and a zip archive (a polyglot); tools would "
            "disagree on what it holds, so it is refused. Re-create it from its source."
        )
    _aliases(path, header)
    return header


def _read_safetensors(path: str | os.PathLike[str]) -> tuple[OrderedDict[str, torch.Tensor], dict[str, str]]:
    # One open file for the header, the checks and the tensors: a file replaced meanwhile (an
    # atomic re-save) is read whole, old or new, never the header of one and the data of the other.
    # The tensors are views of a private (copy-on-write) mapping of that file, as the safetensors
    # library itself reads: no copy until they are used.
    tensors: OrderedDict[str, torch.Tensor] = OrderedDict()
    with open_regular(path) as f, ThreadPoolExecutor(THREADS) as pool:
        header = checked_safetensors_header(path, f)
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if header.file_size else None
        pending = {}
        stamped = CHECKSUM_KEY in header.metadata  # else nothing to check here (a step folder's manifest checks it)
        for entry in header.entries:
            tensors[entry.key] = _tensor_of(mapped, header.data_start, entry)
            if stamped:
                pending[entry.key] = submit_crcs(pool, tensors[entry.key])
        crcs = tensor_crcs(pending)
    verify_tensors(path, crcs, header.metadata)
    for alias, source in _aliases(path, header).items():
        tensors[alias] = tensors[source]
    return tensors, _without_aliases(header.metadata)


def _tensor_of(mapped: mmap.mmap | None, data_start: int, entry: TensorEntry) -> torch.Tensor:
    if not entry.nbytes or mapped is None:
        return torch.empty(entry.shape, dtype=entry.dtype)
    raw = torch.frombuffer(mapped, dtype=torch.uint8, count=entry.nbytes, offset=data_start + entry.begin)
    if (data_start + entry.begin) % entry.dtype.itemsize:
        raw = raw.clone()  # a misaligned tensor (not one safetensors writes): copied to aligned memory
    tensor = raw.view(entry.dtype).reshape(entry.shape)
    if sys.byteorder == "big":  # safetensors stores little-endian
        tensor = torch.from_numpy(tensor.numpy().byteswap())
    return tensor


def _aliases(path: str | os.PathLike[str], header: Header) -> dict[str, str]:
    raw = header.metadata.get(_ALIASES_KEY)
    if raw is None:
        return {}
    keys = {e.key for e in header.entries}
    try:
        aliases = json.loads(raw)
    except (ValueError, RecursionError):
        aliases = None
    if not isinstance(aliases, dict) or not all(
        isinstance(a, str) and isinstance(s, str) and s in keys and a not in keys for a, s in aliases.items()
    ):
        raise CheckpointError(
            f"{str(path)!r} has a damaged {_ALIASES_KEY!r} entry ({reprlib.repr(raw)}); expected a JSON "
            "object mapping new names to tensors of the file."
        )
    return aliases


def _without_aliases(metadata: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in metadata.items() if k != _ALIASES_KEY}


def _deduplicate(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    storages: set[int] = set()
    for key, tensor in tensors.items():
        tensor = tensor.detach().cpu()
        if tensor.is_conj() or tensor.is_neg():  # a lazy conj()/neg view: the values it shows, materialised
            tensor = tensor.resolve_conj().resolve_neg()
        ident = _view_of(tensor)
        if tensor.numel() and ident in seen:
            aliases[key] = seen[ident]
            continue
        shares = tensor.numel() > 0 and _storage_ptr(tensor) in storages
        # A partial view of memory another tensor uses, or a strided view, is written as a copy, in row-major
        # order (clone alone keeps a transposed view's strides, which the writer refuses)
        copy = shares or not packed(tensor)
        unique[key] = tensor.clone(memory_format=torch.contiguous_format) if copy else tensor
        seen[ident] = key
        storages.add(_storage_ptr(tensor))
    return unique, aliases


def _storage_ptr(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


def _view_of(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]:
    # Tensors equal in all of these are the same bytes (tied weights): written once, counted once.
    return (_storage_ptr(tensor), int(tensor.storage_offset()), tuple(tensor.shape), tensor.stride(), tensor.dtype)


# --- bounds on expansion ---


def check_expansion(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str], *, max_expansion: float) -> None:
    """Refuse ``tensors`` (read from ``path``) if, made contiguous, they exceed ``max_expansion`` x the file.

    Views of one storage with the same layout (tied weights) count once.

    Raises:
        CheckpointError: naming the largest tensor, the sizes, and how to allow it.

    Example:
        >>> import tempfile; from pathlib import Path
        >>> p = Path(tempfile.mkdtemp()) / "w.pt"; torch.save({"w": torch.zeros(4)}, p)
        >>> check_expansion({"w": torch.zeros(4)}, p, max_expansion=4.0)
    """
    if math.isinf(max_expansion):
        return
    seen: set[tuple[Any, ...]] = set()
    total, largest, largest_key = 0, 0, ""
    for key, tensor in tensors.items():
        ident = _view_of(tensor)[:4]  # any dtype: the same bytes
        if ident in seen and tensor.numel():
            continue
        seen.add(ident)
        size = tensor.nbytes  # once contiguous; no allocation
        total += size
        if size > largest:
            largest, largest_key = size, key
    check_total(path, os.path.getsize(path), total, (largest_key, largest), max_expansion=max_expansion)


def check_total(
    path: str | os.PathLike[str], on_disk: int, total: int, largest: tuple[str, int], *, max_expansion: float
) -> None:
    """Refuse tensors of ``total`` bytes read from ``on_disk`` bytes at ``path`` beyond ``max_expansion``.

    Raises:
        CheckpointError: naming the largest tensor (``(key, bytes)``), the sizes, and how to allow it.
    """
    if total > max_expansion * on_disk + _SLACK:
        raise CheckpointError(
            f"{str(path)!r} holds {on_disk} bytes but its tensors take {total} bytes once contiguous "
            f"({total / max(on_disk, 1):.3g}x, above the limit of {max_expansion:g}x; largest: {largest[0]!r}, "
            f"{largest[1]} bytes, a strided or expanded view). If you expect this, raise the limit "
            "(CLI: --max-expansion FACTOR, or inf)."
        )
