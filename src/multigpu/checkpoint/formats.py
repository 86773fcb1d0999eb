"""Read and write tensor files in safetensors or torch format, never executing code from a file.

safetensors holds only tensors and a string-to-string header, so reading it cannot run code.
torch files are pickles; they are read with ``torch.load(weights_only=True)``, whose unpickler
only rebuilds tensors and plain containers. A file that needs anything more (a custom class, a
function) is refused with :class:`~multigpu.errors.CheckpointError` naming the globals it wants
and the explicit opt-in, ``allow_unsafe_pickle=True``, for files the user trusts. Even then a
file whose classes cannot be imported here is a CheckpointError naming them and the fix.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import re
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, Literal

import safetensors
import safetensors.torch
import torch

from multigpu.checkpoint.atomic import atomic_write_file, atomic_write_path
from multigpu.errors import CheckpointError, ConfigError

Format = Literal["safetensors", "torch"]
FORMATS: tuple[Format, ...] = ("safetensors", "torch")

_TORCH_SUFFIXES = {".pt", ".pth", ".bin", ".ckpt", ".tar"}
_ALIASES_KEY = "multigpu.aliases"
# Keys under which training scripts commonly nest the model's state dict in a torch file.
_NESTED_MODEL_KEYS = ("state_dict", "model_state_dict", "model", "module")


def format_for(path: str | os.PathLike[str], format: Format | None = None) -> Format:
    """The format to write ``path`` in: ``format`` if given, else by suffix (safetensors by default).

    Example:
        >>> format_for("net.pt"), format_for("net.safetensors"), format_for("net")
        ('torch', 'safetensors', 'safetensors')
    """
    if format is not None:
        if format not in FORMATS:
            raise ConfigError(f"format={format!r} is not one of {FORMATS}; pick one of them.")
        return format
    return "torch" if Path(path).suffix in _TORCH_SUFFIXES else "safetensors"


def detect_format(path: str | os.PathLike[str]) -> Format:
    """The format of an existing file, from its first bytes (the suffix may lie)."""
    with open(path, "rb") as f:
        head = f.read(9)
    # torch: a zip archive (PK) or a legacy pickle (protocol byte 0x80). safetensors: an 8-byte
    # little-endian header length followed by the JSON header's '{'.
    if head[:2] == b"PK" or head[:1] == b"\x80":
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    raise CheckpointError(
        f"{str(path)!r} is neither a safetensors nor a torch file (first bytes {head!r}); "
        "check the path, or whether the file was truncated."
    )


def load_torch_file(
    path: str | os.PathLike[str], *, allow_unsafe_pickle: bool = False, map_location: Any = "cpu"
) -> Any:
    """``torch.load`` that never unpickles arbitrary objects unless explicitly told to.

    Args:
        path: a file written by ``torch.save``.
        allow_unsafe_pickle: load files that need arbitrary unpickling. Only for files you
            trust: unpickling can run any code the file's author chose.
        map_location: passed to ``torch.load``.

    Raises:
        CheckpointError: the file needs arbitrary unpickling and ``allow_unsafe_pickle`` is off,
            or it is on and the file needs a class that cannot be imported here.
    """
    if allow_unsafe_pickle:
        try:
            return torch.load(path, map_location=map_location, weights_only=False)
        except (ImportError, AttributeError) as exc:  # pickle's find_class: no such module, or no such name in it
            missing = [name for name in _pickled_globals(path) if not _importable(name)]
            if not missing:
                raise
            raise CheckpointError(_missing_class_message(path, missing, exc)) from exc
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(_unsafe_message(path)) from exc


def read_tensors(
    path: str | os.PathLike[str], *, allow_unsafe_pickle: bool = False
) -> tuple[OrderedDict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a weights file, by key, and its metadata (safetensors header; empty for torch).

    A torch file may hold the tensors directly or nested under one of ``state_dict``,
    ``model_state_dict``, ``model``, ``module``.
    """
    if detect_format(path) == "safetensors":
        return _read_safetensors(path)
    obj = load_torch_file(path, allow_unsafe_pickle=allow_unsafe_pickle)
    return tensors_of(obj, path), {}


def tensors_of(obj: Any, path: str | os.PathLike[str]) -> OrderedDict[str, torch.Tensor]:
    """The flat key -> tensor mapping inside an object loaded from a torch file."""
    if isinstance(obj, Mapping) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return OrderedDict((str(k), v) for k, v in obj.items())
    if isinstance(obj, Mapping):
        for key in _NESTED_MODEL_KEYS:
            if key in obj and isinstance(obj[key], Mapping):
                return tensors_of(obj[key], path)
    found = list(obj)[:8] if isinstance(obj, Mapping) else type(obj).__name__
    raise CheckpointError(
        f"{str(path)!r} holds no flat mapping of tensors (found {found!r}); expected a state dict, "
        f"possibly nested under one of {list(_NESTED_MODEL_KEYS)}. Save model.state_dict()."
    )


def write_tensors(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    format: Format | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Atomically write ``tensors`` to ``path``; returns the path.

    safetensors refuses tensors that share memory (tied weights): each alias is written once and
    recorded in the header, and :func:`read_tensors` restores it. torch format writes a plain
    state dict that ``torch.load`` + ``load_state_dict`` reads without multigpu.
    """
    if format_for(path, format) == "torch":
        plain = OrderedDict((k, v.detach().cpu()) for k, v in tensors.items())
        return atomic_write_file(path, lambda f: _torch_save(plain, f))
    unique, aliases = _deduplicate(tensors)
    header = {str(k): str(v) for k, v in (metadata or {}).items()}
    header["format"] = "pt"
    if aliases:
        header[_ALIASES_KEY] = json.dumps(aliases)
    return atomic_write_path(path, lambda tmp: _save_safetensors(unique, tmp, header))


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path, header: dict[str, str]) -> None:
    try:
        safetensors.torch.save_file(tensors, str(path), header)
    except safetensors.SafetensorError as exc:
        # The Rust writer reports I/O failures (full disk, size limit) as text: recover the errno
        # so the caller can explain them like any other OSError.
        found = re.search(r"(?:code: |os error )(\d+)", str(exc))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from exc


def _torch_save(obj: Any, f: BinaryIO) -> None:
    torch.save(obj, f)


def _read_safetensors(path: str | os.PathLike[str]) -> tuple[OrderedDict[str, torch.Tensor], dict[str, str]]:
    with safetensors.safe_open(str(path), framework="pt", device="cpu") as f:
        metadata = dict(f.metadata() or {})
        tensors = OrderedDict((key, f.get_tensor(key)) for key in f.keys())  # noqa: SIM118 (safe_open is not iterable)
    for alias, source in json.loads(metadata.pop(_ALIASES_KEY, "{}")).items():
        tensors[alias] = tensors[source]
    return tensors, metadata


def _deduplicate(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    storages: set[int] = set()
    for key, tensor in tensors.items():
        tensor = tensor.detach().cpu()
        ident = (_storage_ptr(tensor), int(tensor.storage_offset()), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if tensor.numel() and ident in seen:
            aliases[key] = seen[ident]
            continue
        shares = tensor.numel() > 0 and _storage_ptr(tensor) in storages
        # A partial view of memory another tensor uses, or a strided view, is written as a copy.
        unique[key] = tensor.clone() if shares or not tensor.is_contiguous() else tensor
        seen[ident] = key
        storages.add(_storage_ptr(tensor))
    return unique, aliases


def _storage_ptr(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


def _pickled_globals(path: str | os.PathLike[str]) -> list[str]:
    """The ``module.name`` globals a torch file's pickle needs beyond tensors and containers (read, not run)."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception:  # not a zip-format torch file, or a torch without this helper
        return []


def _importable(qualified: str) -> bool:
    """Whether ``a.b.C`` resolves here: the longest importable module prefix, then attributes (as unpickling does)."""
    parts = qualified.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except Exception:  # no such module (or one that fails to import): try a shorter prefix
            continue
        try:
            for attr in parts[cut:]:
                found = getattr(found, attr)
        except AttributeError:
            return False
        return True
    return False


def _missing_class_message(path: str | os.PathLike[str], missing: list[str], exc: BaseException) -> str:
    shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
    return (
        f"cannot load {str(path)!r}: its pickle needs {shown}, which cannot be imported here ({exc}). "
        "Run where the code that defined it is importable: from your project's folder, or with that "
        "folder on PYTHONPATH (e.g. PYTHONPATH=/path/to/project). Better, once it loads, re-save the "
        "weights as plain tensors (multigpu ckpt convert), which need no code to read."
    )


def _unsafe_message(path: str | os.PathLike[str]) -> str:
    wanted = _pickled_globals(path)
    shown = ", ".join(wanted[:5]) + (" ..." if len(wanted) > 5 else "") if wanted else "unknown objects"
    return (
        f"refusing to load {str(path)!r}: it needs arbitrary unpickling ({shown}), and "
        "unpickling can run any code the file's author chose. If you trust this file, pass "
        "allow_unsafe_pickle=True (CLI: --allow-unsafe-pickle); better, re-save it as plain "
        "tensors (multigpu ckpt convert)."
    )
