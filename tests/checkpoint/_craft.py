"""Build hostile checkpoint files byte by byte: malformed safetensors headers, doctored torch zips.

Only struct, json, zipfile and torch.save are used, so the same files can be fed to any version
of the library.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def safetensors_bytes(header: dict[str, Any] | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A safetensors file: 8-byte length (``length`` to lie about it), header, data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def torch_records(obj: Any) -> tuple[str, dict[str, bytes]]:
    """The root folder and the records (name -> bytes) of ``torch.save(obj)``."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        records = {info.filename: archive.read(info.filename) for info in archive.infolist()}
    root = next(iter(records)).split("/", 1)[0]
    return root, records


def zip_bytes(records: dict[str, bytes], *, compress: bool = False, duplicate: str | None = None) -> bytes:
    """A zip of ``records``; ``duplicate`` names a record written twice."""
    buffer = io.BytesIO()
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(buffer, "w", method) as archive:
        for name, data in records.items():
            archive.writestr(name, data)
        if duplicate is not None:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                archive.writestr(duplicate, records[duplicate])
    return buffer.getvalue()


def doctored_torch(obj: Any, change: Callable[[str, dict[str, bytes]], dict[str, bytes]], **zip_args: Any) -> bytes:
    root, records = torch_records(obj)
    return zip_bytes(change(root, records), **zip_args)


def without(suffix: str) -> Callable[[str, dict[str, bytes]], dict[str, bytes]]:
    return lambda root, records: {k: v for k, v in records.items() if k != f"{root}/{suffix}"}


def with_pickle(pickle_bytes: bytes) -> Callable[[str, dict[str, bytes]], dict[str, bytes]]:
    return lambda root, records: {**records, f"{root}/data.pkl": pickle_bytes}


def with_member(name: str, data: bytes = b"x") -> Callable[[str, dict[str, bytes]], dict[str, bytes]]:
    return lambda root, records: {**records, name: data}


# A pickle that asks torch's weights-only unpickler (which allows bytearray) for 2**40 bytes.
BYTEARRAY_BOMB = b"\x80\x02cbuiltins\nbytearray\n\x8a\x06\x00\x00\x00\x00\x00\x01\x85R."


def legacy_torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue()


def polyglot_bytes() -> bytes:
    """A valid safetensors file whose single tensor's bytes are a whole zip archive."""
    archive = zip_bytes({"archive/data.pkl": b"\x80\x02}q\x00.", "archive/version": b"3\n"})
    header = {"z": {"dtype": "U8", "shape": [len(archive)], "data_offsets": [0, len(archive)]}}
    return safetensors_bytes(header, archive)


def expanded_tensor_file(path: Path, numel: int = 1 << 40) -> Path:
    """A torch file holding a stride-0 view: 4 bytes on disk, ``4 * numel`` bytes if made contiguous."""
    torch.save({"weight": torch.zeros(1).expand(numel)}, path)
    return path


def billion_laughs_state(levels: int = 64) -> list[Any]:
    """A list whose naive traversal visits 2**levels items (each level holds the previous twice)."""
    node: list[Any] = [0]
    for _ in range(levels):
        node = [node, node]
    return node


MALFORMED_WEIGHTS: dict[str, Callable[[], bytes]] = {
    "empty file": lambda: b"",
    "only a length": lambda: struct.pack("<Q", 2),
    "header too long": lambda: safetensors_bytes(b"{}", length=200_000_000),
    "header longer than the file": lambda: safetensors_bytes(b'{"a": 1}', length=4096),
    "header not JSON": lambda: safetensors_bytes(b"{not json at all}"),
    "header deeply nested": lambda: safetensors_bytes(b"{" + b'"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "header a JSON list": lambda: safetensors_bytes(b"[1, 2]"),
    "duplicate keys": lambda: safetensors_bytes(
        b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
        b'"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
        bytes(8),
    ),
    "negative offsets": lambda: safetensors_bytes(
        {"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, bytes(4)
    ),
    "overlapping offsets": lambda: safetensors_bytes(
        {"a": {**F32, "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [4, 12]}}, bytes(12)
    ),
    "offsets past the file": lambda: safetensors_bytes(
        {"a": {"dtype": "F32", "shape": [100], "data_offsets": [0, 400]}}, bytes(8)
    ),
    "offsets disagree with shape": lambda: safetensors_bytes(
        {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)
    ),
    "negative shape": lambda: safetensors_bytes({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 0]}}),
    "unknown dtype": lambda: safetensors_bytes({"a": {**F32, "dtype": "F4X"}}, bytes(8)),
    "bytes after the data": lambda: safetensors_bytes({"a": F32}, bytes(8) + b"trailing"),
    "metadata not strings": lambda: safetensors_bytes({"__metadata__": {"step": 5}, "a": F32}, bytes(8)),
    "safetensors/zip polyglot": polyglot_bytes,
    "legacy torch pickle renamed": lambda: legacy_torch_bytes({"weight": torch.ones(2)}),
    "torch zip without data.pkl": lambda: doctored_torch({"weight": torch.ones(2)}, without("data.pkl")),
    "torch zip without version": lambda: doctored_torch({"weight": torch.ones(2)}, without("version")),
    "torch zip with a path-traversal member": lambda: doctored_torch(
        {"weight": torch.ones(2)}, with_member("../../etc/evil")
    ),
    "torch zip with an absolute member": lambda: doctored_torch({"weight": torch.ones(2)}, with_member("/etc/evil")),
    "torch zip with a record twice": lambda: doctored_torch(
        {"weight": torch.ones(2)}, lambda root, r: r, duplicate="archive/data.pkl"
    ),
    "torch zip compressed": lambda: doctored_torch({"weight": torch.ones(2)}, lambda root, r: r, compress=True),
    "torch zip asking for a huge bytearray": lambda: doctored_torch(
        {"weight": torch.ones(2)}, with_pickle(BYTEARRAY_BOMB)
    ),
    "torch zip with a truncated pickle": lambda: doctored_torch(
        {"weight": torch.ones(2)}, lambda root, r: {**r, f"{root}/data.pkl": r[f"{root}/data.pkl"][:20]}
    ),
    "torch zip truncated": lambda: doctored_torch({"weight": torch.ones(2)}, lambda root, r: r)[:-30],
}


class _Storage:
    """Stands for a storage record in a crafted pickle (see :func:`torch_with_storage`)."""

    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class _View:
    """Pickles as torch.save pickles a tensor: ``_rebuild_tensor_v2(storage, offset, shape, stride, ...)``."""

    def __init__(self, storage: _Storage, offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.args = (storage, offset, shape, stride)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        from collections import OrderedDict

        return (torch._utils._rebuild_tensor_v2, (*self.args, False, OrderedDict()))


class _StoragePickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
        return None


def torch_with_storage(*, declared: int, record_bytes: int, shape: tuple[int, ...], offset: int = 0) -> bytes:
    """A torch file whose pickle declares one float32 storage of ``declared`` elements, stored in a
    record of ``record_bytes`` bytes, and views it as a contiguous ``weight`` of ``shape``.

    The zip layer is valid (CRCs, names): only the pickle and the record sizes disagree.
    """
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    buffer = io.BytesIO()
    _StoragePickler(buffer, protocol=2).dump({"weight": _View(_Storage("0", declared), offset, shape, stride)})

    def change(root: str, records: dict[str, bytes]) -> dict[str, bytes]:
        kept = {k: v for k, v in records.items() if f"{root}/data/" not in k}
        return {**kept, f"{root}/data.pkl": buffer.getvalue(), f"{root}/data/0": bytes(record_bytes)}

    return doctored_torch({"weight": torch.ones(2)}, change)


# Storage records that contradict what the pickle declares: torch.load refuses them only once it
# reads the data; inspect (which reads none) must see them from the zip directory and the pickle.
CONTRADICTED_STORAGES: dict[str, Callable[[], bytes]] = {
    "storage of 2**40 elements in an 8-byte record": lambda: torch_with_storage(
        declared=1 << 40, record_bytes=8, shape=(2,)
    ),
    "record shorter than its storage": lambda: torch_with_storage(declared=4, record_bytes=8, shape=(4,)),
    "tensor larger than its storage": lambda: torch_with_storage(declared=2, record_bytes=8, shape=(4,)),
}
