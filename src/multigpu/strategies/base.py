"""What a strategy is: the facts it owns and the questions a training loop asks it.

A strategy (``single``, ``dp``, ``ddp``, ``fsdp``: one module each in this package) is one small
object chosen by name from :mod:`multigpu.strategies.registry`. Its class holds its facts, asked
instead of listing names anywhere else: its ``name`` and ``label``, whether it ``needs_processes``
(a launcher starts one per device), its ``options_type``, the ``launch_env`` its workers need.
An instance answers the loop's questions: which device, which shard, how to wrap the model, how
to skip gradient sync while accumulating, which precision object.

A strategy is made from plain values (its constructor only stores them: a test makes one of a
rank it is not); its ``build`` classmethod is where this process is read (the launch environment,
the devices asked for) and those values computed, as :func:`~multigpu.strategies.build_strategy` does.
"""

from __future__ import annotations

import sys
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar, cast

import torch
from torch import nn

from multigpu.devices import DeviceSpec, DeviceType, ReplicaDevice, parse_devices
from multigpu.errors import ConfigError, DeviceError
from multigpu.runtime import world
from multigpu.runtime.data import ShardSpec
from multigpu.runtime.world import DEFAULT_TIMEOUT_S, LaunchEnv
from multigpu.strategies.precision import Precision, build_precision
from multigpu.strategies.sync_batchnorm import apply_sync_batchnorm


class Strategy(ABC):
    """What differs between strategies. Built by :func:`build_strategy`; ``setup`` before use."""

    # -- facts of the strategy, asked by the Session, the launcher, the CLI and the planner ----------

    name: ClassVar[str]
    """The strategy's name everywhere: ``Session(strategy=...)``, ``multigpu launch --strategy``, reports."""
    label: ClassVar[str]
    """How tables and figures call it ("DDP")."""
    needs_processes: ClassVar[bool] = False
    """One process per device, started by a launcher (torchrun); False: it runs in the calling process."""
    multi_device: ClassVar[bool] = True
    """Whether it trains on several devices at once."""
    options_type: ClassVar[type | None] = None
    """The keyword-only dataclass of its options; ``SessionConfig`` holds one in the field named as the strategy."""
    launch_devices: ClassVar[bool] = False
    """Whether ``multigpu launch --devices`` chooses its devices (else the processes' count does)."""
    variants: ClassVar[Mapping[str, str]] = {}
    """Other names the planner gives rows of this strategy (``dp-balanced``), with their labels."""

    @classmethod
    def launch_env(cls, device_type: DeviceType, environ: Mapping[str, str]) -> dict[str, str]:
        """Variables a launched worker of this strategy needs from its start, on ``device_type``.

        The launcher sets them before the worker's interpreter starts (some, such as glibc's malloc
        tunables, are read only then). ``environ`` is what the worker would inherit otherwise.
        """
        return {}

    # -- one process's use of it -------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def build(
        cls,
        *,
        devices: DeviceSpec = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        precision: str = "fp32",
        options: Any = None,
    ) -> Strategy:
        """The strategy of this process: reads what it needs (launch environment, devices asked for).

        Args:
            devices: the devices (see each strategy).
            timeout_s: how long a collective waits for a missing rank.
            precision: the precision's name (``fp32``, ``bf16``, ``fp16``; see :meth:`build_precision`).
            options: the strategy's options (an instance of its ``options_type``; None: the defaults).
                A strategy without options ignores it.
        """

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S, precision: str = "fp32") -> None:
        self.timeout_s = timeout_s
        self.precision_name = precision

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where inputs and the (primary) model live."""

    @property
    def shard(self) -> ShardSpec:
        """Which part of each global batch this process loads."""
        return ShardSpec()

    @property
    def is_main_process(self) -> bool:
        return True

    @property
    def replicas_per_process(self) -> int:
        """How many copies of the model this process trains (one, but dp's threads)."""
        return 1

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (its device index on GPUs)."""
        return 0

    def setup(self) -> None:  # noqa: B027 (optional hook: a no-op by default)
        """Prepare the process (join the process group under ddp)."""

    def teardown(self) -> None:  # noqa: B027 (optional hook: a no-op by default)
        """Undo :meth:`setup`."""

    @abstractmethod
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to the device(s) and wrap it for this strategy."""

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        """The region of an accumulating micro-step: no gradient communication there."""
        return nullcontext()

    def build_precision(self) -> Precision:
        """The object of the strategy's precision (:attr:`precision_name`) for its device."""
        return build_precision(self.precision_name, self.device.type)

    def apply_sync_batchnorm(self, model: nn.Module) -> nn.Module:
        """``model`` with BatchNorm statistics over every process's batch; in one process, unchanged."""
        warnings.warn(
            f"sync_batchnorm=True has no effect under strategy {self.name!r}: one process already "
            "normalizes over the whole batch (it applies under ddp and fsdp)",
            stacklevel=3,
        )
        return model

    def apply_compile(self, model: nn.Module) -> nn.Module:
        """``torch.compile(model)``, ``model`` as :meth:`wrap_model` returned it (``Session(compile=True)``).

        Compiling is lazy: the first forward compiles, on every rank. Where torch documents it per
        strategy: ``single`` compiles the model; ``ddp`` the DDP-wrapped model (DDP's forward runs
        eagerly and dynamo's DDP optimizer splits the graph at bucket boundaries, so the gradient
        all-reduce still overlaps backward); ``fsdp`` the whole model after ``fully_shard`` (FSDP2's
        hooks run eagerly at each group's boundary); ``dp`` does not compile (see its class). The
        first steps compile (tens of seconds on a CPU). The returned module's ``state_dict`` keys
        carry ``_orig_mod.``, which ``session.unwrap``, ``multigpu.save`` and the Checkpointer strip.
        """
        return cast(nn.Module, torch.compile(model))

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:  # noqa: B027 (optional hook)
        """Fail early when ``optimizer`` cannot train the wrapped model (fsdp: built too early)."""


class OneProcessStrategy(Strategy, ABC):
    """Strategies that run in the calling process: refuse to run as one of several launched processes."""

    def setup(self) -> None:
        env = world.read_launch_env()
        if env is not None and env.world_size > 1:
            raise ConfigError(
                f"strategy {self.name!r} runs in one process, but this is rank {env.global_rank} of "
                f"world_size {env.world_size} launched processes (each would train alone); use "
                "strategy='ddp' (or 'auto'), or launch with --nproc-per-node 1"
            )


class ProcessPerDeviceStrategy(Strategy, ABC):
    """Strategies of one launched process per device, joined in a process group (ddp, fsdp)."""

    needs_processes: ClassVar[bool] = True

    def __init__(
        self,
        *,
        env: LaunchEnv,
        device: torch.device,
        options: Any = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        precision: str = "fp32",
    ) -> None:
        super().__init__(timeout_s=timeout_s, precision=precision)
        self.env = env
        self._device = device
        self.options = options  # its options_type's instance (each strategy puts its default)
        self._owns_group = False  # whether setup created the process group (then teardown ends it)

    @classmethod
    def build(
        cls,
        *,
        devices: DeviceSpec = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        precision: str = "fp32",
        options: Any = None,
    ) -> ProcessPerDeviceStrategy:
        """This process's rank (the launch environment) and device (``devices``: the node's, one per process).

        Raises:
            LaunchError: no launcher started this process.
            DeviceError: ``devices`` does not name one device per process of this node.
        """
        env = world.require_launch_env(f"strategy {cls.name!r}")
        if devices is None:
            device = world.process_device(env)
        else:
            device = _check_node_devices(devices, env)[env.local_rank].device  # take this process's
        return cls(env=env, device=device, options=options, timeout_s=timeout_s, precision=precision)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def shard(self) -> ShardSpec:
        return ShardSpec(world_size=self.env.world_size, rank=self.env.global_rank)

    @property
    def is_main_process(self) -> bool:
        return self.env.is_main_process

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    def setup(self) -> None:
        self._owns_group = world.setup_process_group(self.env, self._device, timeout_s=self.timeout_s)

    def teardown(self) -> None:
        if not self._owns_group:  # a group the script (or an outer session) created stays theirs,
            return  # and so do the models wrapped on it: they may still train
        ranks = sys.modules.get("multigpu.checkpoint.ranks")  # not imported: nothing written in it
        if ranks is not None:  # a checkpoint written in the background (fsdp: by every rank) needs the group
            ranks.finish_pending_writes()
        self.release_models()
        world.teardown_process_group()
        self._owns_group = False

    def release_models(self) -> None:
        """Let go of what the wrapped models hold of the process group, before the group is destroyed."""

    def apply_sync_batchnorm(self, model: nn.Module) -> nn.Module:
        return apply_sync_batchnorm(model, self._device)


def _check_node_devices(devices: DeviceSpec, env: LaunchEnv) -> list[ReplicaDevice]:
    """Under a process per device, ``devices`` lists the node's devices: one per launched process."""
    parsed = parse_devices(devices)
    if len(parsed) != env.local_world_size:
        raise DeviceError(
            f"devices={devices!r} names {len(parsed)} device(s) but {env.local_world_size} processes run on "
            f"this node (one per device); relaunch with --nproc-per-node {len(parsed)}, or leave devices out"
        )
    return parsed
