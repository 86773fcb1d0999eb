"""The strategies by name, and the questions asked of all of them (the Session's ``auto``, the planner's rows).

Every other package asks here instead of listing strategy names: the Session builds one with
:func:`build_strategy`; ``multigpu launch`` asks :func:`get_strategy` whether a strategy
``needs_processes`` and which ``launch_env`` its workers get; the planner labels its rows with
:func:`strategy_labels` and spans nodes only with :func:`process_strategies`.

``auto`` (the Session's): what ``multigpu launch --strategy`` asked for; else ``ddp`` inside a
launched run of several processes; else ``dp`` when several GPUs are visible; else ``single``.

Example:
    >>> sorted(STRATEGIES), get_strategy("fsdp").needs_processes
    (['ddp', 'dp', 'fsdp', 'single'], True)
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from multigpu.core.lookup import lookup
from multigpu.errors import ConfigError

if TYPE_CHECKING:
    from multigpu.devices import DeviceSpec
    from multigpu.strategies.base import Strategy

# The one list of strategies: name -> where its class lives (imported on first use, so the CLI lists the names
# without importing torch), or the class itself (register_strategy). Adding one is a module and a line here.
_CLASSES: dict[str, str | type[Strategy]] = {
    "single": "multigpu.strategies.single:SingleStrategy",
    "dp": "multigpu.strategies.dp:DataParallelStrategy",
    "ddp": "multigpu.strategies.ddp:DDPStrategy",
    "fsdp": "multigpu.strategies.fsdp:FSDPStrategy",
}
_AUTO, _SINGLE, _DP, _DDP = "auto", "single", "dp", "ddp"  # the names auto's rule picks between


class _Strategies(Mapping[str, "type[Strategy]"]):
    """``STRATEGIES``: name -> class, in the order listed; a class is imported when first asked for."""

    def __getitem__(self, name: str) -> type[Strategy]:
        found = _CLASSES[name]
        if isinstance(found, str):
            module, _, attribute = found.partition(":")
            found = _CLASSES[name] = getattr(importlib.import_module(module), attribute)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(list(_CLASSES))

    def __len__(self) -> int:
        return len(_CLASSES)

    def __repr__(self) -> str:
        return f"STRATEGIES({', '.join(_CLASSES)})"


STRATEGIES: Mapping[str, type[Strategy]] = _Strategies()


def strategy_names() -> tuple[str, ...]:
    """Every strategy's name, in the order listed, without importing any strategy (nor torch).

    Example:
        >>> strategy_names()
        ('single', 'dp', 'ddp', 'fsdp')
    """
    return tuple(_CLASSES)


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Make ``cls`` a strategy under ``cls.name`` (an out-of-tree one, or a test's); returns it.

    It is then a choice of ``Session(strategy=...)``, ``multigpu launch --strategy`` and ``multigpu advise
    --measure --strategies`` (the planner's rows are its own table: ``multigpu.planning.costs.PLANNED``).

    Raises:
        ConfigError: the name is ``auto`` or a strategy's already (unregister it first).
    """
    if cls.name == _AUTO or cls.name in _CLASSES:
        raise ConfigError(
            f"strategy {cls.name!r} is registered already (or is 'auto'); call "
            f"unregister_strategy({cls.name!r}) first to replace it, or give the class another name"
        )
    _CLASSES[cls.name] = cls
    return cls


def unregister_strategy(name: str) -> None:
    """Forget the strategy ``name`` (no-op when unknown)."""
    _CLASSES.pop(name, None)


def get_strategy(name: str) -> type[Strategy]:
    """The strategy class called ``name`` (its facts are class attributes).

    Raises:
        ConfigError: ``name`` is not a strategy.
    """
    return lookup(
        STRATEGIES,
        name,
        "strategy={value!r} is not one of {choices}; use e.g. strategy='ddp'",
        choices=[_AUTO, *_CLASSES],
    )


def strategy_labels() -> dict[str, str]:
    """Every name a report gives a strategy's row (variants after their strategy), and its label.

    Example:
        >>> strategy_labels()["dp-balanced"]
        'balanced DataParallel'
    """
    return {key: text for cls in STRATEGIES.values() for key, text in {cls.name: cls.label, **cls.variants}.items()}


def process_strategies() -> tuple[str, ...]:
    """The strategies of one launched process per device (the ones that can span nodes), variants included."""
    return tuple(name for cls in STRATEGIES.values() if cls.needs_processes for name in (cls.name, *cls.variants))


def multi_device_strategies() -> tuple[str, ...]:
    """The strategies (and variants) that train on several devices at once."""
    return tuple(name for cls in STRATEGIES.values() if cls.multi_device for name in (cls.name, *cls.variants))


def resolve_strategy_name(name: str) -> str:
    """The concrete strategy ``name`` stands for (``auto`` resolved as the module docstring says).

    Raises:
        ConfigError: ``name`` is neither ``auto`` nor a known strategy.
    """
    from multigpu.devices import several_accelerators
    from multigpu.runtime import world

    if name != _AUTO:
        return get_strategy(name).name
    requested = world.requested_strategy()
    if requested and requested != _AUTO:
        return resolve_strategy_name(requested)
    env = world.read_launch_env()
    if env is not None and env.world_size > 1:
        return _DDP
    if several_accelerators() is not None:
        return _DP
    return _SINGLE


def launched_auto(processes: int, *, multi_node: bool) -> str:
    """What ``multigpu launch --strategy auto`` runs: ddp over several processes or nodes, else single."""
    return _DDP if processes > 1 or multi_node else _SINGLE


def build_strategy(
    name: str,
    *,
    devices: DeviceSpec = None,
    timeout_s: float | None = None,
    precision: str = "fp32",
    **options: Any,
) -> Strategy:
    """The strategy object for ``name`` (``auto`` resolved), built for this process. Joins no process group yet.

    Args:
        name: a strategy's name, or ``auto``.
        devices: the devices (see each strategy).
        timeout_s: how long a collective waits for a missing rank (None: ``runtime.world.DEFAULT_TIMEOUT_S``).
        precision: the precision's name (``fp32``, ``bf16``, ``fp16``): the strategy builds its object
            (:meth:`Strategy.build_precision`), and fsdp shards the model in it.
        options: each strategy's options by its name (``ddp=DDPOptions(...)``, ``fsdp=FSDPOptions(...)``);
            the strategy built takes its own and ignores the others'.
    """
    from multigpu.runtime.world import DEFAULT_TIMEOUT_S

    cls = STRATEGIES[resolve_strategy_name(name)]
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    return cls.build(devices=devices, timeout_s=timeout_s, precision=precision, options=options.get(cls.name))
