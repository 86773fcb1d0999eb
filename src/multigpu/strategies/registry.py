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

from typing import Any

from multigpu.devices import DeviceSpec, several_accelerators
from multigpu.errors import ConfigError
from multigpu.runtime import world
from multigpu.runtime.world import DEFAULT_TIMEOUT_S
from multigpu.strategies.base import Strategy
from multigpu.strategies.ddp import DDPStrategy
from multigpu.strategies.dp import DataParallelStrategy
from multigpu.strategies.fsdp import FSDPStrategy
from multigpu.strategies.single import SingleStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (SingleStrategy, DataParallelStrategy, DDPStrategy, FSDPStrategy)
}


def get_strategy(name: str) -> type[Strategy]:
    """The strategy class called ``name`` (its facts are class attributes).

    Raises:
        ConfigError: ``name`` is not a strategy.
    """
    if name not in STRATEGIES:
        raise ConfigError(f"strategy={name!r} is not one of {['auto', *STRATEGIES]}; use e.g. strategy='ddp'")
    return STRATEGIES[name]


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
    if name != "auto":
        return get_strategy(name).name
    requested = world.requested_strategy()
    if requested and requested != "auto":
        return resolve_strategy_name(requested)
    env = world.read_launch_env()
    if env is not None and env.world_size > 1:
        return DDPStrategy.name
    if several_accelerators() is not None:
        return DataParallelStrategy.name
    return SingleStrategy.name


def launched_auto(processes: int, *, multi_node: bool) -> str:
    """What ``multigpu launch --strategy auto`` runs: ddp over several processes or nodes, else single."""
    return DDPStrategy.name if processes > 1 or multi_node else SingleStrategy.name


def build_strategy(
    name: str,
    *,
    devices: DeviceSpec = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    precision: str = "fp32",
    **options: Any,
) -> Strategy:
    """The strategy object for ``name`` (``auto`` resolved), built for this process. Joins no process group yet.

    Args:
        name: a strategy's name, or ``auto``.
        devices: the devices (see each strategy).
        timeout_s: how long a collective waits for a missing rank.
        precision: the precision's name (``fp32``, ``bf16``, ``fp16``): the strategy builds its object
            (:meth:`Strategy.build_precision`), and fsdp shards the model in it.
        options: each strategy's options by its name (``ddp=DDPOptions(...)``, ``fsdp=FSDPOptions(...)``);
            the strategy built takes its own and ignores the others'.
    """
    cls = STRATEGIES[resolve_strategy_name(name)]
    return cls.build(devices=devices, timeout_s=timeout_s, precision=precision, options=options.get(cls.name))
