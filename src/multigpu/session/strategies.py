"""Strategies: how one training script uses the devices. Small objects chosen by name.

- ``single``: one process, one device.
- ``dp``: one process, one replica per device in threads (:class:`multigpu.DataParallel`); the
  loader yields the whole global batch and the engine splits it.
- ``ddp``: one process per device, started by ``multigpu launch`` (or torchrun), gradients
  all-reduced by torch's ``DistributedDataParallel``; each process loads its shard of the batch.
- ``fsdp``: as ``ddp``, but parameters, gradients and optimizer state are sharded over the
  processes by torch's FSDP2 (:mod:`multigpu.session.fsdp`).
- ``auto``: what ``multigpu launch --strategy`` asked for; else ``ddp`` inside a launched run of
  several processes; else ``dp`` when several GPUs are visible; else ``single``.

A strategy answers the few questions a training loop has (which device, which shard, how to wrap
the model, how to skip gradient sync while accumulating); everything else is shared.
"""

from __future__ import annotations

import gc
import os
import warnings
import weakref
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from multigpu.devices import DeviceSpec, ReplicaDevice, accelerator_type, device_count, parse_devices
from multigpu.distributed import runtime
from multigpu.distributed.data import ShardSpec
from multigpu.distributed.runtime import LaunchEnv
from multigpu.errors import ConfigError, DeviceError
from multigpu.parallel import DataParallel
from multigpu.session import fsdp
from multigpu.session.compile import apply_compile
from multigpu.session.ddp_options import DDPOptions, build_ddp
from multigpu.session.fsdp import FSDPOptions
from multigpu.session.precision import Precision, build_precision
from multigpu.session.sync_batchnorm import apply_sync_batchnorm


class Strategy(ABC):
    """What differs between strategies. Built by :func:`build_strategy`; ``setup`` before use."""

    name: ClassVar[str]

    def __init__(
        self,
        *,
        devices: DeviceSpec = None,
        timeout_s: float = runtime.DEFAULT_TIMEOUT_S,
        ddp: DDPOptions | None = None,
        fsdp: FSDPOptions | None = None,
    ) -> None:
        self.devices = devices
        self.timeout_s = timeout_s
        self.ddp = ddp or DDPOptions()  # each strategy reads the options of its own kind only
        self.fsdp = fsdp or FSDPOptions()

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

    def build_precision(self, name: str) -> Precision:
        """The precision object called ``name`` for this strategy's device."""
        return build_precision(name, self.device.type)

    def apply_sync_batchnorm(self, model: nn.Module) -> nn.Module:
        """``model`` with BatchNorm statistics over every process's batch; in one process, unchanged."""
        warnings.warn(
            f"sync_batchnorm=True has no effect under strategy {self.name!r}: one process already "
            "normalizes over the whole batch (it applies under ddp and fsdp)",
            stacklevel=3,
        )
        return model

    def apply_compile(self, model: nn.Module) -> nn.Module:
        """``model`` (as :meth:`wrap_model` returned it) compiled (see :mod:`multigpu.session.compile`)."""
        return apply_compile(model)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:  # noqa: B027 (optional hook)
        """Fail early when ``optimizer`` cannot train the wrapped model (fsdp: built too early)."""


class _OneProcess(Strategy, ABC):
    """Strategies that run in one process: refuse to run as one of several launched processes."""

    def setup(self) -> None:
        env = runtime.read_launch_env()
        if env is not None and env.world_size > 1:
            raise ConfigError(
                f"strategy {self.name!r} runs in one process, but this is rank {env.global_rank} of "
                f"world_size {env.world_size} launched processes (each would train alone); use "
                "strategy='ddp' (or 'auto'), or launch with --nproc-per-node 1"
            )


class SingleStrategy(_OneProcess):
    """One process, one device (default: the first GPU, else the CPU)."""

    name: ClassVar[str] = "single"

    def __init__(self, *, devices: DeviceSpec = None, **options: Any) -> None:
        super().__init__(devices=devices, **options)
        parsed = parse_devices(devices)
        if devices is not None and len(parsed) > 1:
            raise ConfigError(
                f"strategy 'single' runs on one device but devices={devices!r} names {len(parsed)}; "
                "use strategy='dp' (threads) or 'ddp' (processes) for several"
            )
        self._device = parsed[0].device

    @property
    def device(self) -> torch.device:
        return self._device

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model.to(self._device)


class DataParallelStrategy(_OneProcess):
    """One process, one replica per device in threads (default: every GPU, else two CPU replicas)."""

    name: ClassVar[str] = "dp"

    def __init__(self, *, devices: DeviceSpec = None, **options: Any) -> None:
        super().__init__(devices=devices, **options)
        spec = devices if devices is not None else runtime.requested_devices()
        replicas = parse_devices(spec)
        if spec is None and len(replicas) == 1 and replicas[0].type == "cpu":
            replicas = parse_devices("cpu:2")  # no GPU: two CPU replicas still exercise the engine
        self.replicas: list[ReplicaDevice] = replicas

    @property
    def replicas_per_process(self) -> int:
        return len(self.replicas)

    @property
    def device(self) -> torch.device:
        return self.replicas[0].device

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return DataParallel(model.to(self.device), devices=[r.label for r in self.replicas])

    def apply_compile(self, model: nn.Module) -> nn.Module:
        warnings.warn(
            "compile=True has no effect under strategy 'dp': its replicas are copied from the model at "
            "every step, which torch.compile would retrace; compile under 'single', 'ddp' or 'fsdp'",
            stacklevel=3,
        )
        return model


class DDPStrategy(Strategy):
    """One process per device, launched; gradients all-reduced by DistributedDataParallel."""

    name: ClassVar[str] = "ddp"

    def __init__(self, *, devices: DeviceSpec = None, **options: Any) -> None:
        super().__init__(devices=devices, **options)
        self.env: LaunchEnv = runtime.require_launch_env(f"strategy {self.name!r}")
        self._wrapped: list[weakref.ref[DistributedDataParallel]] = []
        self._owns_group = False  # whether setup created the process group (then teardown ends it)
        self._device = runtime.process_device(self.env)
        if devices is not None:  # the node's devices, one per process: take this process's
            self._device = _check_ddp_devices(devices, self.env)[self.env.local_rank].device

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
        self._owns_group = runtime.setup_process_group(self.env, self._device, timeout_s=self.timeout_s)

    def teardown(self) -> None:
        if not self._owns_group:  # a group the script (or an outer session) created stays theirs,
            return  # and so do the models wrapped on it: they may still train
        # Release every DDP reducer before the group goes. In a plain torch script, destroying a
        # gloo group while a DDP model still held its reducer aborted the process at exit
        # ("terminate called without an active exception") in 4 of 12 runs here, 0 of 12 with
        # the reducer released first (pytorch/pytorch#190489 shows the same symptom).
        for ref in self._wrapped:
            model = ref()
            if model is not None and hasattr(model, "reducer"):
                del model.reducer
                model.logger = None
        self._wrapped.clear()
        gc.collect()
        runtime.teardown_process_group()
        self._owns_group = False

    def wrap_model(self, model: nn.Module) -> nn.Module:
        wrapped = build_ddp(model.to(self._device), self._device, self.ddp)  # broadcasts rank 0's weights
        self._wrapped.append(weakref.ref(wrapped))
        return wrapped

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        model = getattr(model, "_orig_mod", model)  # the DDP module inside a torch.compile wrapper
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return nullcontext()

    def apply_sync_batchnorm(self, model: nn.Module) -> nn.Module:
        return apply_sync_batchnorm(model, self._device)


class FSDPStrategy(DDPStrategy):
    """One process per device, launched; parameters, gradients and optimizer state sharded by FSDP2."""

    name: ClassVar[str] = "fsdp"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sharded: list[weakref.ref[nn.Module]] = []
        self._checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._precision = "fp32"

    def build_precision(self, name: str) -> Precision:
        self._precision = name  # wrap_model's MixedPrecisionPolicy follows it
        return fsdp.build_fsdp_precision(name, self._device.type)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if not self._sharded and self.is_main_process:  # once, from rank 0
            fsdp.warn_if_started_without_sharding_env(self._device, os.environ)
        sharded = fsdp.apply_fsdp(model.to(self._device), self._device, self.fsdp, self._precision)
        self._sharded.append(weakref.ref(sharded))
        return sharded

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        return fsdp.gradient_sync_off(model)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer not in self._checked:  # once per optimizer: its parameters do not change
            fsdp.check_optimizer(optimizer, self._sharded)
            self._checked.add(optimizer)


def _check_ddp_devices(devices: DeviceSpec, env: LaunchEnv) -> list[ReplicaDevice]:
    """Under ddp, ``devices`` lists the node's devices: one per launched process."""
    parsed = parse_devices(devices)
    if len(parsed) != env.local_world_size:
        raise DeviceError(
            f"devices={devices!r} names {len(parsed)} device(s) but {env.local_world_size} processes run on "
            f"this node (one per device); relaunch with --nproc-per-node {len(parsed)}, or leave devices out"
        )
    return parsed


STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (SingleStrategy, DataParallelStrategy, DDPStrategy, FSDPStrategy)
}


def resolve_strategy_name(name: str) -> str:
    """The concrete strategy ``name`` stands for (``auto`` resolved as the module docstring says).

    Raises:
        ConfigError: ``name`` is neither ``auto`` nor a known strategy.
    """
    if name != "auto":
        if name not in STRATEGIES:
            raise ConfigError(f"strategy={name!r} is not one of {['auto', *STRATEGIES]}; use e.g. strategy='ddp'")
        return name
    requested = runtime.requested_strategy()
    if requested and requested != "auto":
        return resolve_strategy_name(requested)
    env = runtime.read_launch_env()
    if env is not None and env.world_size > 1:
        return "ddp"
    if accelerator_type() == "cuda" and device_count("cuda") > 1:
        return "dp"
    return "single"


def build_strategy(
    name: str,
    *,
    devices: DeviceSpec = None,
    timeout_s: float = runtime.DEFAULT_TIMEOUT_S,
    ddp: DDPOptions | None = None,
    fsdp: FSDPOptions | None = None,
) -> Strategy:
    """The strategy object for ``name`` (``auto`` resolved). Does not join any process group yet."""
    return STRATEGIES[resolve_strategy_name(name)](devices=devices, timeout_s=timeout_s, ddp=ddp, fsdp=fsdp)
