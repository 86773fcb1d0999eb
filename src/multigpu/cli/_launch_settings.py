"""Where each of ``multigpu launch``'s settings comes from: command line, config file, scheduler, default.

Highest first:

1. a flag on the command line;
2. a key of the ``--config`` TOML file, named like the long flag (``nproc-per-node = 2``;
   ``nproc_per_node`` is accepted too, not both; a switch such as ``no-bind-cores`` takes ``true``; a UTF-8
   file of at most 1 MiB);
3. what the scheduler says about this node (:func:`multigpu.runtime.world.scheduler_launcher_defaults`):
   torchrun's ``PET_*`` variables (Kubeflow's PyTorchJob), or the nodes and node rank of a SLURM step;
4. the flag's default.

A key that names no flag is an error naming the nearest flag; a value is checked as the flag's
would be. Example ``run.toml``::

    strategy = "ddp"
    nproc-per-node = 2
    grace-period = 120
"""

from __future__ import annotations

import argparse
import difflib
import importlib
from pathlib import Path
from typing import Any

from multigpu.errors import ConfigError

_ACTIONS = "_settings_actions"
_NOT_IN_FILE = {"help", "config"}


class _Unset:
    """A flag's default, marked so that :func:`resolve` can tell it from a value the user typed."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def mark_defaults(parser: argparse.ArgumentParser) -> None:
    """Mark every flag's default so :func:`resolve` knows which flags the command line set. Call it last."""
    actions = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    for action in actions:
        action.default = _Unset(action.default)
    parser.set_defaults(**{_ACTIONS: tuple(actions)})


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with every flag the command line left unset taken from the config file, the scheduler or its default.

    Raises:
        ConfigError: the config file is missing, not TOML, has a key that names no flag (the nearest
            flag is named) or a value the flag refuses.
    """
    actions: tuple[argparse.Action, ...] = getattr(args, _ACTIONS, ())
    by_name = {_long_name(a): a for a in actions}
    config = getattr(args, "config", None)
    config_path = config.value if isinstance(config, _Unset) else config
    if config_path is not None and not str(config_path).strip():
        raise ConfigError(f"--config {config_path!r} is empty; pass the path of a TOML file (e.g. run.toml)")
    from_file = _read_config(Path(config_path), by_name) if config_path else {}
    from_scheduler: dict[str, Any] = {}
    if any(isinstance(getattr(args, a.dest), _Unset) for a in actions):
        from multigpu.runtime.world import scheduler_launcher_defaults  # imports torch: only when launching

        scheduler, values = scheduler_launcher_defaults()
        for name, text in values.items():
            if name in by_name:
                source = f"PET_{name.upper().replace('-', '_')}" if scheduler == "torchrun" else f"{scheduler}'s value"
                from_scheduler[name] = _convert(by_name[name], text, f"{source}={text!r} (for --{name})")
    resolved = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != _ACTIONS})
    for name, action in by_name.items():
        current = getattr(args, action.dest)
        if not isinstance(current, _Unset):
            continue
        if name in from_file:
            value = from_file[name]
        elif name in from_scheduler:
            value = from_scheduler[name]
        else:
            value = current.value
        setattr(resolved, action.dest, value)
    return resolved


def _long_name(action: argparse.Action) -> str:
    longs = [s for s in action.option_strings if s.startswith("--")]
    return (longs or action.option_strings)[0].lstrip("-")


_MAX_CONFIG_BYTES = 1 << 20  # a launch's flags fit in a few hundred bytes; a bigger file is the wrong file


def _load_toml(path: Path) -> dict[str, Any]:
    for module in ("tomllib", "tomli"):  # tomllib: Python 3.11+; tomli: the same parser for 3.10
        try:
            toml = importlib.import_module(module)
        except ImportError:
            continue
        text = _read_text(path)
        try:
            return dict(toml.loads(text))
        except toml.TOMLDecodeError as exc:
            raise ConfigError(
                f"--config {path}: not valid TOML ({exc}); write keys as e.g. nproc-per-node = 2"
            ) from exc
        except RecursionError:  # the parser recurses once per level of nested arrays or tables
            raise ConfigError(
                f"--config {path}: values nested too deep for the TOML parser; the keys are flags with one "
                "value each, e.g. nproc-per-node = 2"
            ) from None
    raise ConfigError(f"--config {path}: reading TOML needs Python 3.11+ or the 'tomli' package (pip install tomli)")


def _read_text(path: Path) -> str:
    try:
        with path.open("rb") as file:
            data = file.read(_MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            f"--config {path}: cannot be read ({exc.strerror or exc}); pass a TOML file you can read"
        ) from exc
    if len(data) > _MAX_CONFIG_BYTES:
        raise ConfigError(
            f"--config {path}: larger than {_MAX_CONFIG_BYTES} bytes, not a file of launch flags; pass the TOML "
            "file with e.g. nproc-per-node = 2"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"--config {path}: not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}); TOML files are "
            "UTF-8: save it as UTF-8"
        ) from None


def _read_config(path: Path, by_name: dict[str, argparse.Action]) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"--config {path}: no such file; pass the path of a TOML file (e.g. run.toml)")
    if not path.is_file():  # a folder, a pipe or a device: nothing to parse, or a read that never ends
        raise ConfigError(f"--config {path}: not a regular file; pass the path of a TOML file (e.g. run.toml)")
    values: dict[str, Any] = {}
    spelt: dict[str, str] = {}
    for key, raw in _load_toml(path).items():
        name = key.replace("_", "-")
        if name not in by_name or name in _NOT_IN_FILE:
            choices = [n for n in by_name if n not in _NOT_IN_FILE]
            near = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
            hint = (
                f"did you mean '{near[0]}'?" if near else f"the keys are the long flags: {', '.join(sorted(choices))}"
            )
            raise ConfigError(f"--config {path}: {key!r} is not a flag of multigpu launch; {hint}")
        if name in spelt:
            raise ConfigError(
                f"--config {path}: {spelt[name]!r} and {key!r} both set --{name}; keep one of the two spellings"
            )
        spelt[name] = key
        values[name] = _convert(by_name[name], raw, f"--config {path}: {key} = {raw!r}")
    return values


def _convert(action: argparse.Action, raw: Any, where: str) -> Any:
    """``raw`` as the flag would have parsed it (its type and choices), or a ConfigError saying where it came from."""
    name = _long_name(action)
    if action.nargs == 0:  # a switch (store_true/store_false): true sets it, false leaves the default
        if not isinstance(raw, bool):
            raise ConfigError(f"{where}: --{name} is a switch; write {name} = true (or leave it out)")
        return action.const if raw else _default(action)
    if isinstance(raw, (dict, list, bool)):
        raise ConfigError(f"{where}: --{name} takes one value, e.g. {name} = {_example(action)}")
    value: Any = str(raw)
    if action.type is not None:
        try:
            value = action.type(value)  # type: ignore[operator]
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            raise ConfigError(f"{where}: --{name} refuses it ({exc}); e.g. {name} = {_example(action)}") from None
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where}: --{name} takes one of {', '.join(map(str, action.choices))}")
    return value


def _default(action: argparse.Action) -> Any:
    return action.default.value if isinstance(action.default, _Unset) else action.default


def _example(action: argparse.Action) -> str:
    if action.choices:
        return f'"{next(iter(action.choices))}"'
    return "2" if action.type in (int, float) else '"..."'
