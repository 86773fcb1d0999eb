"""One training step of a model: counted without running it, or timed on this CPU; and its workload.

A model built on the meta device has shapes and no data, so its forward and backward cost
nothing but the Python that drives them (as ``accelerate estimate-memory`` does): a ResNet-50
at batch 400 is counted in about a second, where running it on this CPU would need ~40 GB.

What is counted, per step (forward, the loss, backward):

- FLOPs of matmuls, convolutions and attention (torch's :class:`FlopCounterMode`), with one
  correction: torch counts the weight gradient of a grouped convolution ``groups`` times too
  often (its backward comes out as ``(1 + groups)`` forwards: a depthwise MobileNetV2 6.8x too
  expensive, a ResNeXt 2.2x). Here each gradient of a convolution, input or weight, costs what
  its forward does: every (input, weight, output) product of the forward appears once in each.
- aten ops dispatched (a ``TorchDispatchMode``), and of them those that launch a kernel on a
  device: views and allocations do not;
- nn.Module calls (Python's share of a forward), modules, parameters and buffers (replicate);
- bytes saved for backward (``saved_tensors_hooks``; parameters and inputs are not activations),
  bytes of the first output and of the inputs.

A GPU plan turns the counts into a workload with the GPU's peak (:func:`counted_workload`); a plan
on this CPU times forward + backward of one batch and the optimizer step (a low quantile of repeats) and
keeps as per-sample compute what the host's share (counts x host costs) leaves (:func:`measure_workload`).

Example:
    >>> from torch import nn
    >>> with torch.device("meta"):
    ...     net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    >>> counted = count_step(net, torch.empty(16, 64, device="meta"))
    >>> counted.flops == 2 * 16 * (64 * 32 + 32 * 8) * 3 - 2 * 16 * 64 * 32  # no input gradient
    True
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from multigpu.core.lookup import lookup
from multigpu.devices import synchronizer
from multigpu.errors import ConfigError
from multigpu.planning.costs import host_step_s
from multigpu.planning.hardware import DEFAULT_HOST, GpuSpec, HostCosts
from multigpu.planning.left_as_found import left_as_found
from multigpu.planning.timing import CPU_CLOCK, low_quantile, quantile_s
from multigpu.planning.workload import FP32_UTILIZATION, StepCounts, Workload, compute_s_per_sample

LossFn = Callable[[Any], torch.Tensor]
# Per-sample compute never drops below this share of the measured step: host costs measured on a
# busy machine can exceed what the step itself took.
_MIN_DEVICE_SHARE = 0.1
OPTIMIZER_REPEATS = 7  # optimizer steps timed, each after an untimed backward (optimizer_step_s)
aten = torch.ops.aten

# Ops that allocate or describe memory without running a kernel.
_NO_KERNEL = {aten.empty, aten.empty_strided, aten.empty_like, aten.lift_fresh, aten._local_scalar_dense}


def default_loss(output: Any) -> torch.Tensor:
    """Mean square of the first output: a stand-in loss with the shape of a real one."""
    tensor = output if isinstance(output, torch.Tensor) else output[0]
    return tensor.float().square().mean()


def _conv_backward_flop(
    grad_out_shape: list[int],
    x_shape: list[int],
    w_shape: list[int],
    _bias: Any,
    _stride: Any,
    _padding: Any,
    _dilation: Any,
    transposed: bool,
    _output_padding: Any,
    _groups: Any,
    output_mask: list[bool],
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    """Each requested gradient (input, weight) of a convolution costs one forward's FLOPs.

    torch's own formula counts the weight gradient as a convolution over all input channels,
    ``groups`` times the real work for a grouped convolution.
    """
    forward = conv_flop_count(x_shape, w_shape, grad_out_shape, transposed=transposed)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


_CONVOLUTIONS = {aten.convolution, aten._convolution, aten.cudnn_convolution, aten.convolution_backward}


@dataclass(frozen=True)
class Counted:
    """One step of one batch, counted."""

    batch: int
    counts: StepCounts
    flops: float  # forward + backward
    conv_flops: float  # the convolutions' share (TF32 tensor cores run them on Ampere and later)
    params: int  # trainable
    saved_bytes: int  # activations saved for backward (forward and loss)
    output_bytes: int  # the first output
    input_bytes: int


class OpCounter(TorchDispatchMode):
    """Counts dispatched aten ops: ``ops["kernels"]`` launch one, ``ops["other"]`` (views, allocations) do not."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kernel = not func.is_view and func.overloadpacket not in _NO_KERNEL
        self.ops["kernels" if kernel else "other"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return self.ops["kernels"] + self.ops["other"]


def _storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


@dataclass
class _Passes:
    """What the three counting passes saw."""

    output: Any = None
    module_calls: int = 0
    saved: dict[int, int] = field(default_factory=dict)  # storage -> bytes, saved for backward
    forward_ops: OpCounter = field(default_factory=OpCounter)
    backward_ops: OpCounter = field(default_factory=OpCounter)
    flops: FlopCounterMode = field(
        default_factory=lambda: FlopCounterMode(
            display=False, custom_mapping={aten.convolution_backward: _conv_backward_flop}
        )
    )


def _run_passes(model: nn.Module, inputs: torch.Tensor, loss_fn: LossFn) -> _Passes:
    """Three passes, so that no counter sees another's work: unpacking saved tensors through hooks
    adds a detach per tensor to backward, and FlopCounterMode's module tracker adds autograd hooks."""
    seen = _Passes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.saved[_storage_key(t)] = t.untyped_storage().nbytes()
        return t

    def called(*_: object) -> None:
        seen.module_calls += 1

    hook = nn.modules.module.register_module_forward_pre_hook(called)
    try:
        with seen.forward_ops, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            seen.output = model(inputs)
            loss_fn(seen.output)
        hook.remove()
        loss = loss_fn(model(inputs))
        with seen.backward_ops:
            loss.backward()
        model.zero_grad(set_to_none=True)
        with seen.flops:
            loss_fn(model(inputs)).backward()
    finally:
        hook.remove()
        model.zero_grad(set_to_none=True)
    return seen


def count_step(model: nn.Module, inputs: torch.Tensor, *, loss_fn: LossFn = default_loss) -> Counted:
    """Count one forward, loss and backward of ``model`` on ``inputs`` (meta tensors cost nothing).

    Args:
        model: the model, on the meta device (or any device: it then really runs once).
        inputs: one batch on the model's device (dim 0 is the batch).
        loss_fn: output -> scalar loss.

    Returns:
        The counts of that step; divide the byte and FLOP fields by ``batch`` for per-sample figures.

    Raises:
        ConfigError: an empty batch, or an op that cannot run on the meta device (the message names it).
    """
    if inputs.dim() == 0 or inputs.shape[0] == 0:
        raise ConfigError(f"inputs of shape {tuple(inputs.shape)} hold no batch; pass at least one sample on dim 0")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            f"{type(model).__name__} has no parameter that requires a gradient, so a training step has nothing to "
            "compute or update; unfreeze the parameters to train (requires_grad_(True)) before planning"
        )
    not_activations = {_storage_key(t) for t in [*model.parameters(), *model.buffers(), inputs]}
    try:
        with left_as_found(model, inputs.device):  # a real model runs once: its state and the streams put back
            seen = _run_passes(model, inputs, loss_fn)
    except (NotImplementedError, RuntimeError) as exc:
        raise ConfigError(
            f"counting one step of {type(model).__name__} failed: {exc}; if an op has no meta kernel, plan "
            "on this CPU (no --gpu) or pass --compute-ms, --activation-mb and --output-mb"
        ) from exc
    first = seen.output if isinstance(seen.output, torch.Tensor) else seen.output[0]
    per_op = seen.flops.get_flop_counts().get("Global", {})
    counts = StepCounts(
        modules=sum(1 for _ in model.modules()),
        tensors=sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers()),
        module_calls=seen.module_calls,
        forward_ops=seen.forward_ops.total,
        backward_ops=seen.backward_ops.total,
        forward_kernels=seen.forward_ops.ops["kernels"],
        backward_kernels=seen.backward_ops.ops["kernels"],
    )
    return Counted(
        batch=int(inputs.shape[0]),
        counts=counts,
        flops=float(seen.flops.get_total_flops()),
        conv_flops=float(sum(n for op, n in per_op.items() if op in _CONVOLUTIONS)),
        params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        saved_bytes=sum(n for key, n in seen.saved.items() if key not in not_activations),
        output_bytes=first.numel() * first.element_size(),
        input_bytes=inputs.numel() * inputs.element_size(),
    )


def count_fsdp_groups(model: nn.Module, blocks: Sequence[nn.Module]) -> tuple[int, ...]:
    """Trainable parameters per fsdp all-gather group: the root's own first, then ``blocks`` in forward order.

    ``blocks`` are the submodules ``fully_shard`` is applied to, children before parents (as
    :func:`multigpu.strategies.fsdp.select_blocks` returns them): each claims the parameters no
    earlier block claimed, and the root keeps the rest. Forward order is taken to be the order
    the modules were registered in.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        >>> count_fsdp_groups(net, [net[1]])
        (20, 10)
    """
    owner: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for param in block.parameters():
            owner.setdefault(id(param), i)
    sizes, root = [0] * len(blocks), 0
    for param in model.parameters():
        if not param.requires_grad:
            continue
        if id(param) in owner:
            sizes[owner[id(param)]] += param.numel()
        else:
            root += param.numel()
    position = {id(m): k for k, m in enumerate(model.modules())}
    order = sorted(range(len(blocks)), key=lambda i: position.get(id(blocks[i]), len(position)))
    return (root, *[sizes[i] for i in order if sizes[i]])


def count_flops(model: nn.Module, inputs: torch.Tensor, *, loss_fn: LossFn = default_loss) -> float:
    """FLOPs of one forward + backward of ``inputs``, grouped convolutions counted correctly."""
    return count_step(model, inputs, loss_fn=loss_fn).flops


def counted_workload(
    counted: Counted, gpu: GpuSpec, *, name: str, utilization: float = FP32_UTILIZATION, optimizer: str = "adam"
) -> Workload:
    """The workload of a counted step (:func:`multigpu.planning.counting.count_step`) on ``gpu``."""
    b = counted.batch
    return Workload(
        name=name,
        params=counted.params,
        compute_s_per_sample=compute_s_per_sample(
            counted.flops / b, counted.conv_flops / counted.flops if counted.flops else 0.0, gpu, utilization
        ),
        input_bytes_per_sample=counted.input_bytes / b,
        output_bytes_per_sample=counted.output_bytes / b,
        activation_bytes_per_sample=counted.saved_bytes / b,
        optimizer=optimizer,
        counts=counted.counts,
    )


def optimizer_step_s(
    opt: torch.optim.Optimizer,
    backward: Callable[[], None],
    *,
    repeats: int = OPTIMIZER_REPEATS,
    clock: Callable[[], float] = CPU_CLOCK,
    sync: Callable[[], object] = lambda: None,
) -> float:
    """Seconds of ``opt.step()`` and ``zero_grad(set_to_none=True)`` as a training step runs them: each right
    after a ``backward()`` (untimed), on fresh gradients and the caches as backward left them; the
    :data:`~multigpu.planning.timing.QUANTILE` of ``repeats`` after one warm-up (the state's first step).

    The same step repeated on one set of gradients reads less: 0.9-1.0 against 1.6 ms for the
    benchmark's MLP at 64 samples, 0.11-0.17 against 0.58-0.64 ms for its CNN at 16, on one thread of
    the 2 development cores at load 9 (the gradients are new memory each step, and backward has
    evicted the weights and the optimizer's state). ``sync``: waits for an accelerator's work (a sync
    point inside the timed region).
    """
    times = []
    for _ in range(repeats + 1):
        backward()
        start = clock()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(clock() - start)
    return low_quantile(times[1:])


def measure_workload(
    model: nn.Module,
    inputs: torch.Tensor,
    *,
    loss_fn: LossFn = default_loss,
    optimizer: str = "sgd-momentum",
    repeats: int = 7,
    name: str = "model",
    host: HostCosts = DEFAULT_HOST,
) -> Workload:
    """Measure ``model`` on the device its parameters are on, with a batch ``inputs``.

    Args:
        model: the model, on its device.
        inputs: one batch (dim 0 is the batch); a small one is enough, compute scales linearly.
        loss_fn: output -> scalar loss (default: mean square of the first output).
        optimizer: ``sgd``, ``sgd-momentum``, ``adam`` or ``adamw``: the step that is timed.
        repeats: timed repeats; their low quantile is kept (:mod:`multigpu.planning.timing`): of the
            thread's CPU time on a CPU with one intra-op thread (other processes only keep it off
            the core), else of the wall time (other threads' or an accelerator's work is in it).
        name: the workload's name in reports.
        host: the host costs whose share of the timed step is not per-sample compute.

    Returns:
        Per-sample compute seconds, activation/output/input bytes per sample, parameters, host
        counts and the measured optimizer step.
    """
    counted = count_step(model, inputs, loss_fn=loss_fn)
    batch = counted.batch
    sync = synchronizer([inputs.device])  # waits for any accelerator (cuda, xpu, mps); no-op on the CPU

    def compute() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model(inputs)).backward()
        sync()  # a sync point: the time must include the device's work

    one_thread = inputs.device.type == "cpu" and torch.get_num_threads() == 1
    clock = CPU_CLOCK if one_thread else time.perf_counter
    with left_as_found(model, inputs.device):  # the timed steps move the weights: the user's model is put back
        opt = build_optimizer(optimizer, model)
        step_s = quantile_s(compute, repeats, clock=clock)
        optimizer_s = optimizer_step_s(opt, compute, repeats=repeats, clock=clock, sync=sync)
    return Workload(
        name=name,
        params=counted.params,
        compute_s_per_sample=device_seconds(step_s, host_step_s(counted.counts, host)) / batch,
        input_bytes_per_sample=counted.input_bytes / batch,
        output_bytes_per_sample=counted.output_bytes / batch,
        activation_bytes_per_sample=counted.saved_bytes / batch,
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        optimizer=optimizer,
        optimizer_s=optimizer_s,
        counts=counted.counts,
    )


def device_seconds(step_s: float, host_s: float) -> float:
    """What a timed step leaves to the device once the host's share is out (at least a tenth of it).

    Example:
        >>> device_seconds(1.0, 0.25), device_seconds(1.0, 5.0)
        (0.75, 0.1)
    """
    return max(step_s - host_s, _MIN_DEVICE_SHARE * step_s)


def build_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer the planner's ``--optimizer`` names (``sgd``, ``sgd-momentum``, ``adam``, ``adamw``) over ``model``."""
    build = lookup(_OPTIMIZERS, name, "optimizer={value!r} is not one of {choices}; pass one of them (--optimizer)")
    return build(list(model.parameters()))


_OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-4),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
}
