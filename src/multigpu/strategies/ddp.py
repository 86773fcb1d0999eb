"""The ``ddp`` strategy: one launched process per device, gradients all-reduced by torch's DDP.

Each process loads its shard of the global batch (:mod:`multigpu.runtime.data`); DDP broadcasts
rank 0's weights when it wraps the model and all-reduces the gradients in buckets during backward.
Its knobs, reachable from the Session, are :class:`DDPOptions`:

    Session(strategy="ddp", ddp=DDPOptions(find_unused_parameters=True, comm_hook="bf16"))

The fields mirror ``torch.nn.parallel.DistributedDataParallel``'s arguments of the same names (same
defaults); ``comm_hook`` names one of torch's gradient-compression hooks. A model whose forward
leaves some parameters unused fails in DDP's *next* forward with "Expected to have finished
reduction in the prior iteration"; :func:`build_ddp` turns that error into a :class:`ConfigError`
naming the parameters and their modules (:mod:`multigpu.strategies.unused_parameters`) and
``DDPOptions(find_unused_parameters=True)``.
"""

from __future__ import annotations

import gc
import inspect
import weakref
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from multigpu.core.lookup import lookup
from multigpu.errors import ConfigError
from multigpu.runtime.world import DEFAULT_TIMEOUT_S, LaunchEnv
from multigpu.strategies.base import ProcessPerDeviceStrategy
from multigpu.strategies.unused_parameters import unused_parameter_names

COMM_HOOKS = ("fp16", "bf16", "powersgd")

# DDP's own message when a parameter got no gradient in the previous iteration's backward.
_UNFINISHED_REDUCTION = "Expected to have finished reduction in the prior iteration"

# torch 2.13 renamed DDP's broadcast_buffers (now deprecated, with a FutureWarning) to
# forward_sync_buffers; both switch off the buffer broadcast at each forward.
_BUFFER_SYNC_ARGUMENT = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)


@dataclass(frozen=True, kw_only=True)
class DDPOptions:
    """How the ddp strategy builds ``DistributedDataParallel`` (ignored by the other strategies).

    Attributes:
        find_unused_parameters: walk the autograd graph after each forward to find parameters the
            loss did not use (a branch not taken); needed when some parameters get no gradient,
            costs a graph traversal per step.
        static_graph: the set of used parameters never changes between steps (lets DDP skip the
            traversal and supports re-entrant activation checkpointing).
        gradient_as_bucket_view: gradients are views into DDP's all-reduce buckets (saves one
            gradient copy of memory).
        bucket_cap_mb: size of one all-reduce bucket in MiB (smaller: earlier overlap, more messages).
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm running statistics) to every rank
            at each forward (torch >= 2.13 calls it ``forward_sync_buffers``).
        comm_hook: compress the gradients DDP all-reduces: ``None`` (exact), ``"fp16"`` or
            ``"bf16"`` (cast to 16 bits for the all-reduce, back after), ``"powersgd"`` (low-rank
            approximation with error feedback; see the two fields below).
        powersgd_rank: PowerSGD's matrix approximation rank (torch's default 1; higher: closer
            to the exact gradient, more bytes).
        powersgd_start_iter: steps of exact all-reduce before PowerSGD starts (torch's default
            1000; at least 2, as PowerSGD's error feedback needs them).
    """

    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = True
    bucket_cap_mb: float = 25.0
    broadcast_buffers: bool = True
    comm_hook: str | None = None
    powersgd_rank: int = 1
    powersgd_start_iter: int = 1000

    def __post_init__(self) -> None:
        lookup(
            dict.fromkeys((None, *COMM_HOOKS)),
            self.comm_hook,
            "DDPOptions(comm_hook={value!r}) is not one of {choices}; use e.g. comm_hook='bf16', or None for the "
            "exact all-reduce",
            choices=[None, *COMM_HOOKS],
        )
        if not self.bucket_cap_mb > 0:
            raise ConfigError(f"DDPOptions(bucket_cap_mb={self.bucket_cap_mb}) must be > 0 MiB (torch's default 25)")
        if self.powersgd_rank < 1:
            raise ConfigError(f"DDPOptions(powersgd_rank={self.powersgd_rank}) must be >= 1")
        if self.powersgd_start_iter < 2:
            raise ConfigError(
                f"DDPOptions(powersgd_start_iter={self.powersgd_start_iter}) must be >= 2: PowerSGD's error "
                "feedback starts after two exact all-reduces"
            )
        for name in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "broadcast_buffers"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"DDPOptions({name}={getattr(self, name)!r}) must be True or False")


class _DistributedDataParallel(DistributedDataParallel):
    """torch's DDP whose unused-parameter error names the option that fixes it."""

    def _pre_forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # DDP raises this error here, at the start of the forward *after* the step whose backward
        # left parameters unreduced, where the training loop cannot tell why.
        try:
            return super()._pre_forward(*inputs, **kwargs)
        except RuntimeError as exc:
            if _UNFINISHED_REDUCTION not in str(exc):
                raise
            names = unused_parameter_names(self.module, str(exc), self.parameters_to_ignore)
            which = f": {', '.join(names)}" if names else ""
            raise ConfigError(
                f"DDP found parameters that received no gradient in the previous step{which} (the forward did not "
                "use them for the loss, e.g. a branch not taken); pass "
                "Session(ddp=DDPOptions(find_unused_parameters=True)), or make every parameter take part "
                f"in the loss. (torch: {str(exc).split('. ')[0]}.)"
            ) from exc


def build_ddp(model: nn.Module, device: torch.device, options: DDPOptions) -> DistributedDataParallel:
    """``model`` (on ``device``) wrapped in DDP with ``options``; every rank must call it.

    Args:
        model: the module, already on ``device``.
        device: this process's device (an accelerator's: DDP's single ``device_ids`` entry).
        options: the :class:`DDPOptions`.

    Returns:
        The DDP module (a subclass of ``DistributedDataParallel``); rank 0's weights are broadcast.

    Example:
        >>> build_ddp(nn.Linear(4, 2), torch.device("cpu"), DDPOptions())  # doctest: +SKIP
    """
    device_ids = None if device.type == "cpu" else [device.index]  # DDP: one device id for an accelerator module
    buffers: dict[str, Any] = {}
    if not options.broadcast_buffers:  # DDP's default is True; passing it at all warns on torch >= 2.13
        buffers = {_BUFFER_SYNC_ARGUMENT: False}
    wrapped = _DistributedDataParallel(
        model,
        device_ids=device_ids,
        find_unused_parameters=options.find_unused_parameters,
        static_graph=options.static_graph,
        gradient_as_bucket_view=options.gradient_as_bucket_view,
        bucket_cap_mb=options.bucket_cap_mb,
        **buffers,
    )
    if options.comm_hook is not None:
        _register_comm_hook(wrapped, options)
    return wrapped


def _register_comm_hook(model: DistributedDataParallel, options: DDPOptions) -> None:
    if options.comm_hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif options.comm_hook == "bf16":
        model.register_comm_hook(None, _bf16_compress_hook)
    else:
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=options.powersgd_rank,
            start_powerSGD_iter=options.powersgd_start_iter,
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def _bf16_compress_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    """(ProcessGroup | None, GradBucket) -> Future[Tensor]: torch's bf16 compression, on every backend.

    torch's ``bf16_compress_hook`` is this same call (``_compress_hook(torch.bfloat16, ...)``), but
    DDP's ``_check_comm_hook`` refuses it by its name unless the backend is nccl ("BF16 all reduce
    communication hook required CUDA 11+ and NCCL 2.10+"); gloo all-reduces bfloat16 tensors fine,
    so one hook under another name serves whatever backend the device type uses. No annotations:
    ``_check_comm_hook`` compares them with the classes themselves, and this module's postponed
    annotations are strings.
    """
    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


class DDPStrategy(ProcessPerDeviceStrategy):
    """One process per device, launched; gradients all-reduced by DistributedDataParallel."""

    name: ClassVar[str] = "ddp"
    label: ClassVar[str] = "DDP"
    options_type: ClassVar[type | None] = DDPOptions
    options: DDPOptions

    def __init__(
        self,
        *,
        env: LaunchEnv,
        device: torch.device,
        options: DDPOptions | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        precision: str = "fp32",
    ) -> None:
        super().__init__(
            env=env, device=device, options=options or DDPOptions(), timeout_s=timeout_s, precision=precision
        )
        self._wrapped: list[weakref.ref[DistributedDataParallel]] = []

    def release_models(self) -> None:
        # Release every DDP reducer before the group goes. In a plain torch script, destroying a
        # gloo group while a DDP model still held its reducer aborted the process at exit
        # ("terminate called without an active exception") in 4 of 12 runs here, 0 of 12 with
        # the reducer released first (pytorch/pytorch#190489 shows the same symptom).
        # The collection then frees the models the script dropped inside reference cycles (the last one
        # stayed uncollected while this loop's variable held it). It runs with no model wrapped too: skipped
        # there, a rank raising in launch_function closed its group so fast that its peer's consequence
        # was named as the cause (test_a_function_from_stdin_twice_then_an_error_and_no_process_left).
        for ref in self._wrapped:
            drop_reducer(ref())
        self._wrapped.clear()
        gc.collect()

    def wrap_model(self, model: nn.Module) -> nn.Module:
        wrapped = build_ddp(model.to(self.device), self.device, self.options)  # broadcasts rank 0's weights
        self._wrapped.append(weakref.ref(wrapped))
        return wrapped

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        model = getattr(model, "_orig_mod", model)  # the DDP module inside a torch.compile wrapper
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return nullcontext()


def drop_reducer(model: DistributedDataParallel | None) -> None:
    """Let go of ``model``'s reducer (and the logger that holds it too); None: the model was collected."""
    if model is not None and hasattr(model, "reducer"):
        del model.reducer
        model.logger = None
