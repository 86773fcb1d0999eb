"""Check every field of a checkpoint's training state before anything is applied.

Resume is all or nothing: :func:`check_training_state` and the ``check_*`` functions below
look at the loaded ``state.pt`` only (types, ranges, sizes, structure against the live
optimizer/scheduler/scaler), and random states are tried on private generators, so that
applying afterwards cannot fail half-way. Every refusal is a
:class:`~multigpu.errors.CheckpointError` naming the file, the entry and what was expected.

Walks over loaded data are bounded: containers deeper than :data:`MAX_DEPTH` or that contain
themselves are refused, and a container reached twice (pickles share objects) is walked once.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from multigpu.checkpoint.atomic import MAX_STEP, MAX_WORLD_SIZE, STATE_FILE, parse_aside, parse_step
from multigpu.checkpoint.file_kinds import SHORT, entry_is, refuse
from multigpu.checkpoint.formats import check_plain_tensor
from multigpu.checkpoint.ranks import device_rng_keys
from multigpu.errors import CheckpointError

FORMAT_VERSION = 1
MAX_DEPTH = 32
_ENTRIES = ("format_version", "step", "epoch", "world_size", "rng", "optimizer", "scheduler", "scaler")
_NUMBER = (int, float)
_LEAVES = (int, float, str, bool, type(None), complex)
# Per-parameter buffers of torch's optimizers: each has its parameter's shape.
_PER_PARAMETER = {"momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "square_avg", "acc_delta", "sum"}


@dataclass(frozen=True, kw_only=True)
class TrainingState:
    """A checked ``state.pt``: every field has the type and range below."""

    step: int
    epoch: int
    world_size: int
    rng: list[dict[str, Any]]  # one random state per rank, each tried on private generators
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None
    data_position: dict[str, Any]
    extra: dict[str, Any]
    model_checksum: str | None  # the checksum of the weights saved with it (older checkpoints: None)
    global_step: int | None = None  # session.global_step when it was saved (older checkpoints: None)


@dataclass(frozen=True)
class Refusal:
    """Raises the CheckpointError of one file: ``fail(entry, found, expected)``."""

    file: Path
    device: str | None = "cpu"  # where its tensors must be: state.pt's load on the CPU (None: any device)

    def fail(self, entry: str, found: Any, expected: str) -> NoReturn:
        refuse(
            self.file,
            entry_is(entry, found, expected) + ". Nothing was loaded (model, optimizer, scheduler, scaler and "
            "random state are as before)",
            "The checkpoint is damaged or was written for another setup: resume from another step "
            "(Checkpointer.resume(path=...)) or pass the objects it was saved with.",
        )


def check_training_state(obj: Any, folder: Path, *, allow_objects: bool = False, meta: bool = False) -> TrainingState:
    """The checked ``state.pt`` of ``folder`` (``obj``: what it unpickled to).

    Args:
        folder: the step folder; the state must repeat the step in its name (or aside name), if it has one.
        allow_objects: accept any object in ``data_position`` and ``extra`` (the file was loaded
            with ``allow_unsafe_pickle=True``, so the caller trusts it).
        meta: the file was loaded onto the ``meta`` device (a summary): random states are not tried.

    Raises:
        CheckpointError: the first entry that is missing or wrong.
    """
    r = Refusal(folder / STATE_FILE)
    folder_step = parse_step(folder.name)
    folder_step = parse_aside(folder.name) if folder_step is None else folder_step
    if not isinstance(obj, dict):
        r.fail("the state", obj, "a dict of the entries a Checkpointer writes")
    for entry in (*_ENTRIES, "data_position", "extra"):
        if entry not in obj:
            r.fail(f"entry {entry!r}", "missing", "every entry a Checkpointer writes")
    if type(obj["format_version"]) is not int or obj["format_version"] != FORMAT_VERSION:
        r.fail("entry 'format_version'", obj["format_version"], f"{FORMAT_VERSION} (this multigpu's format)")
    step = _count(r, obj, "step", 0, MAX_STEP)
    if folder_step is not None and step != folder_step:
        r.fail("entry 'step'", step, f"{folder_step}, the step in the folder's name")
    world = _count(r, obj, "world_size", 1, MAX_WORLD_SIZE)
    rngs = obj["rng"]
    if not isinstance(rngs, list) or len(rngs) != world:
        r.fail("entry 'rng'", rngs, f"a list of {world} random states, one per rank")
    for entry in ("optimizer", "scheduler", "scaler"):
        if obj[entry] is not None and not isinstance(obj[entry], dict):
            r.fail(f"entry {entry!r}", obj[entry], "None or a state dict")
    counters = {}
    for entry in ("data_position", "extra"):
        value = obj[entry]
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            r.fail(f"entry {entry!r}", value, "a dict with string keys")
        if not allow_objects:
            walk_plain(value, f"entry {entry!r}", r.fail, device="meta" if meta else "cpu")
        counters[entry] = value
    checksum = obj.get("model_checksum")
    if checksum is not None and (not isinstance(checksum, str) or len(checksum) > 100):
        r.fail("entry 'model_checksum'", checksum, "a checksum string")
    global_step = None if obj.get("global_step") is None else _count(r, obj, "global_step", 0, MAX_STEP)
    checked = TrainingState(
        global_step=global_step,
        model_checksum=checksum,
        step=step,
        epoch=_count(r, obj, "epoch", 0, MAX_STEP),
        world_size=world,
        rng=rngs,
        optimizer=obj["optimizer"],
        scheduler=obj["scheduler"],
        scaler=obj["scaler"],
        data_position=counters["data_position"],
        extra=counters["extra"],
    )
    for rank, state in enumerate([] if meta else checked.rng):
        check_rng(r, state, f"entry 'rng'[{rank}]")
    return checked


def _count(r: Refusal, obj: dict[str, Any], entry: str, low: int, high: int) -> int:
    value = obj[entry]
    if type(value) is not int or not low <= value <= high:
        r.fail(f"entry {entry!r}", value, f"an int from {low} to {high}")
    return value


def walk_plain(
    value: Any, where: str, fail: Callable[[str, Any, str], NoReturn], *, device: str | None = "cpu"
) -> None:
    """Require ``value`` to be tensors (dense, on ``device``), numbers, strings, lists, tuples and dicts, bounded.

    ``fail(where, found, expected)`` is called for the first offending item.
    """
    seen: set[int] = set()  # containers already checked (the pickle memo shares them)
    path: set[int] = set()  # the containers above this one: one of them again is a cycle

    def walk(value: Any, where: str, depth: int) -> None:
        if isinstance(value, _LEAVES):
            return
        if isinstance(value, torch.Tensor):
            try:
                check_plain_tensor(value, where, device=device)
            except CheckpointError as exc:
                fail(where, value, f"a plain dense tensor ({exc})")
            return
        if not isinstance(value, (dict, list, tuple)):
            fail(where, value, "tensors, numbers, strings, lists, tuples and dicts")
        if depth >= MAX_DEPTH:
            fail(where, "a deeper container", f"nesting of at most {MAX_DEPTH} levels")
        if id(value) in path:
            fail(where, "a container holding itself", "no reference cycles")
        if id(value) in seen:
            return
        seen.add(id(value))
        path.add(id(value))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(value, dict) and not isinstance(key, (str, int, float, bool, type(None))):
                fail(f"{where}[{SHORT.repr(key)}]", key, "a key that is a string or a number")
            walk(item, f"{where}[{SHORT.repr(key)}]", depth + 1)
        path.discard(id(value))

    walk(value, where, 0)


def check_rng(r: Refusal, state: Any, where: str) -> None:
    """Require a random state that :func:`~multigpu.checkpoint.ranks.restore_rng` accepts.

    Each part is set on a private generator (python, numpy, torch), never on the global ones.
    """
    devices = device_rng_keys()
    required = {"python", "numpy", "torch"}
    if not isinstance(state, dict) or not required <= set(state) <= required | set(devices):
        maybe = ", ".join(repr(name) for name in devices)
        r.fail(where, state, f"a dict with 'python', 'numpy', 'torch' (and maybe {maybe}) random states")
    _try(r, f"{where}['python']", state["python"], "a python random state", _python_state)
    _try(r, f"{where}['numpy']", state["numpy"], "a numpy MT19937 state", _numpy_state)
    torch_state = state["torch"]
    if not _is_byte_tensor(torch_state) or torch_state.shape != torch.get_rng_state().shape:
        r.fail(f"{where}['torch']", torch_state, f"a uint8 tensor of shape {tuple(torch.get_rng_state().shape)}")
    _try(r, f"{where}['torch']", torch_state, "a torch random state", lambda s: torch.Generator().set_state(s))
    for name in devices:
        per_device = state.get(name)
        if per_device is not None and (
            not isinstance(per_device, (list, tuple)) or not all(_is_byte_tensor(t) for t in per_device)
        ):
            r.fail(f"{where}[{name!r}]", per_device, f"a list of uint8 tensors, one per {name} device")


def _python_state(saved: Any) -> None:
    version, internal, gauss = saved
    if type(version) is not int or not isinstance(internal, (list, tuple)) or len(internal) != 625:
        raise ValueError("wrong shape")
    if not all(type(x) is int for x in internal) or not (gauss is None or isinstance(gauss, float)):
        raise ValueError("wrong types")
    random.Random().setstate((version, tuple(internal), gauss))


def _numpy_state(saved: Any) -> None:
    if not isinstance(saved, dict) or set(saved) != {"kind", "keys", "pos", "has_gauss", "cached_gaussian"}:
        raise ValueError("wrong entries")
    keys = saved["keys"]
    if (
        type(keys) is not torch.Tensor
        or keys.dtype != torch.int64
        or keys.shape != (624,)
        or keys.layout != torch.strided
    ):
        raise ValueError("keys must be an int64 tensor of shape (624,)")
    if int(keys.min()) < 0 or int(keys.max()) >= 2**32:
        raise ValueError("keys out of range")
    scalars = (saved["pos"], saved["has_gauss"], saved["cached_gaussian"])
    if type(saved["kind"]) is not str or not all(type(s) in (int, float, bool) for s in scalars):
        raise ValueError("wrong types")
    np.random.RandomState().set_state((saved["kind"], keys.numpy().astype(np.uint32), *scalars))


def _try(r: Refusal, where: str, value: Any, expected: str, attempt: Callable[[Any], Any]) -> None:
    try:
        attempt(value)
    except Exception:  # whatever the generator says, it did not accept the state
        r.fail(where, value, expected)


def _is_byte_tensor(value: Any) -> bool:
    return (
        type(value) is torch.Tensor
        and value.dtype == torch.uint8
        and value.layout == torch.strided
        and value.device.type == "cpu"
        and value.dim() == 1
    )


def check_like(r: Refusal, saved: Any, live: Any, where: str, depth: int = 0) -> None:
    """Require ``saved`` to have the structure of ``live`` (a scheduler's or scaler's state dict).

    Dict keys must be ones the live object has, lists keep their length, numbers stay numbers,
    strings strings, tensors keep their shape; a live ``None`` accepts any plain value.
    """
    if depth >= MAX_DEPTH:
        r.fail(where, "a deeper container", f"nesting of at most {MAX_DEPTH} levels")
    if live is None:
        walk_plain(saved, where, r.fail, device=r.device)
    elif isinstance(live, Mapping):
        if not isinstance(saved, dict):
            r.fail(where, saved, f"a dict like the live object's ({SHORT.repr(dict(live))})")
        unknown = [k for k in saved if k not in live]
        if unknown:
            r.fail(where, f"keys {unknown[:5]}", f"only the keys of the live object ({sorted(map(str, live))[:12]})")
        for key, value in saved.items():
            check_like(r, value, live[key], f"{where}[{key!r}]", depth + 1)
    elif isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
            r.fail(where, saved, f"a list of {len(live)} items, like the live object's")
        for i, (item, live_item) in enumerate(zip(saved, live)):
            check_like(r, item, live_item, f"{where}[{i}]", depth + 1)
    elif isinstance(live, (int, float)):  # bool is an int
        if not isinstance(saved, (bool, int, float)):
            r.fail(where, saved, f"a number, like the live value {live!r}")
    elif isinstance(live, str):
        if not isinstance(saved, str):
            r.fail(where, saved, f"a string, like the live value {live!r}")
    elif isinstance(live, torch.Tensor):
        walk_plain(saved, where, r.fail, device=r.device)
        if not isinstance(saved, torch.Tensor) or saved.shape != live.shape:
            r.fail(where, saved, f"a tensor of shape {tuple(live.shape)}")
    else:
        walk_plain(saved, where, r.fail, device=r.device)


def check_scaler(r: Refusal, saved: dict[str, Any], live: Any) -> None:
    """A GradScaler's state: the live scaler's entries, each a finite positive number (tracker >= 0)."""
    check_like(r, saved, live.state_dict(), "entry 'scaler'")
    for key, value in saved.items():
        bad = isinstance(value, bool) or not isinstance(value, _NUMBER) or not np.isfinite(value)
        if bad or value < 0 or (value == 0 and key != "_growth_tracker"):
            r.fail(f"entry 'scaler'[{key!r}]", value, "a finite positive number")


def check_optimizer(r: Refusal, saved: dict[str, Any], optimizer: Any) -> None:
    """An optimizer's state dict that ``optimizer.load_state_dict`` takes without error or surprise.

    Same number of parameter groups and parameters per group as the live optimizer, option values
    shaped like the live ones, per-parameter state keyed by the saved parameter ids, and buffers
    with their parameter's shape (so nothing is allocated beyond what the model already uses).
    """
    if set(saved) != {"state", "param_groups"}:
        r.fail("entry 'optimizer'", sorted(map(str, saved))[:8], "the keys 'state' and 'param_groups'")
    groups, live_groups = saved["param_groups"], optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(live_groups):
        r.fail(
            "entry 'optimizer'['param_groups']", groups, f"a list of {len(live_groups)} groups, like the optimizer's"
        )
    params: dict[int, torch.Tensor] = {}
    for i, (group, live) in enumerate(zip(groups, live_groups)):
        _check_group(r, group, live, f"entry 'optimizer'['param_groups'][{i}]", params)
    state = saved["state"]
    if not isinstance(state, dict):
        r.fail("entry 'optimizer'['state']", state, "a dict from parameter id to its state")
    for pid, per_param in state.items():
        where = f"entry 'optimizer'['state'][{SHORT.repr(pid)}]"
        if type(pid) is not int or pid not in params:
            r.fail(where, pid, "the id of a parameter listed in param_groups")
        if not isinstance(per_param, dict) or not all(isinstance(k, str) for k in per_param):
            r.fail(where, per_param, "a dict of named buffers")
        for key, value in per_param.items():
            _check_buffer(r, value, params[pid], key, f"{where}[{key!r}]")


def _check_group(r: Refusal, group: Any, live: dict[str, Any], where: str, params: dict[int, torch.Tensor]) -> None:
    if not isinstance(group, dict) or not isinstance(group.get("params"), list):
        r.fail(where, group, "a dict with a 'params' list")
    ids = group["params"]
    if len(ids) != len(live["params"]) or not all(type(i) is int for i in ids):
        r.fail(f"{where}['params']", ids, f"{len(live['params'])} parameter ids (ints), like the optimizer's group")
    for pid, param in zip(ids, live["params"]):
        if pid in params:
            r.fail(f"{where}['params']", pid, "ids that appear once across all groups")
        params[pid] = param
    for key, value in group.items():
        if key != "params":
            check_like(r, value, live.get(key), f"{where}[{key!r}]")


def _check_buffer(r: Refusal, value: Any, param: torch.Tensor, key: str, where: str) -> None:
    walk_plain(value, where, r.fail, device=r.device)
    if not isinstance(value, torch.Tensor):
        return
    if key in _PER_PARAMETER and value.shape != param.shape:
        r.fail(where, f"a tensor of shape {tuple(value.shape)}", f"its parameter's shape {tuple(param.shape)}")
    # Loading casts buffers to the parameter's dtype: a copy, which must not exceed what is there.
    limit = max(value.untyped_storage().nbytes(), param.numel() * param.element_size(), 64)
    if value.nbytes > limit:  # bytes once contiguous
        r.fail(
            where,
            f"a view of {value.nbytes} bytes over {value.untyped_storage().nbytes()}",
            "a plain buffer",
        )
