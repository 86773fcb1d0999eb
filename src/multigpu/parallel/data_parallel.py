"""``multigpu.DataParallel``: nn.DataParallel's one line, on any device, with the fixes.

One step: scatter the inputs on ``dim`` -> replicate the module from the primary device ->
run the replicas in parallel threads -> gather the outputs on ``output_device``. After
``loss.backward()`` the primary module's ``.grad`` equals the single-device gradient of the same
batch. What it keeps from nn.DataParallel and what it fixes is listed in the README.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache, partial
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from multigpu.core.keys import add_module_prefix, drop_module_prefix
from multigpu.core.listeners import Listener, ListenerHandle, Listeners
from multigpu.core.lookup import lookup
from multigpu.core.structure import Flat, flatten, iter_tensors
from multigpu.devices import DeviceSpec, ReplicaDevice, get_device_type, parse_devices, parse_output_device
from multigpu.errors import ConfigError, PlacementError
from multigpu.parallel import backward
from multigpu.parallel.balance import AutoBalancer, BalancePlan, imbalance_warning
from multigpu.parallel.chunks import build_policy
from multigpu.parallel.random_turns import backward_turns, forward_turns, in_turn
from multigpu.parallel.replicas import build_replicas
from multigpu.parallel.scatter_gather import ScalarRule, batch_size, merge_outputs, split_inputs
from multigpu.parallel.threads import ReplicaThreads, run_replicas

_SCALAR_RULES = ("mean", "sum", "stack")
_REDUCTIONS = ("mean", "sum")  # a loss_fn's reduction the replicas' losses combine under


class DataParallel(nn.Module):
    """Split each batch across devices, run a replica of ``module`` on each, gather the outputs.

    Args:
        module: the model, with its parameters and buffers on the primary device.
        device_ids: accelerator indices, as in nn.DataParallel (``[0, 1]``).
        output_device: where outputs are gathered (default: the primary device): an accelerator
            index (``-1``: the CPU, as in nn.DataParallel), a device string or a torch.device.
        dim: the batch dimension of inputs and outputs (negative: counted from each tensor's last).
        devices: any devices instead of ``device_ids``: ``"cpu:2"``, ``"cuda:0,1"``,
            ``["cuda:0", "cuda:1"]``. Default (neither given): every visible GPU, else the CPU.
        chunk_sizes: how to split the batch: ``None`` (even), ints summing to the batch
            (``[24, 40]``), float weights (``[0.4, 0.6]``) or ``"auto"`` (equal peak memory,
            see :mod:`multigpu.parallel.balance`).
        loss_fn: compute the loss on the replicas: call ``model(x, target=y)``; each replica
            applies ``loss_fn(output, target)`` to its chunk, only the scalar losses travel to
            the primary, and the call returns the whole-batch loss. The replicas' outputs stay on
            their devices in ``model.replica_outputs``. Without ``target=`` (inference) the
            call returns the gathered outputs as usual.
        loss_reduction: ``"mean"`` or ``"sum"``: how the replica losses combine (default: the
            ``reduction`` attribute of ``loss_fn``, else ``"mean"``, weighted by chunk size).
        gather_outputs: ``False`` gathers only 0-dim outputs (a loss the model computes itself)
            and leaves every other output on its replica (``model.replica_outputs``); the
            returned structure holds None in their place.
        scalar_outputs: how 0-dim outputs combine: ``"mean"`` weights by chunk size (equals a
            mean-reduced loss over the batch), ``"sum"``, or ``"stack"`` (nn.DataParallel's vector).
        parallel_backward: run each replica's backward in its own thread (needed for CPU
            replicas to overlap). ``False`` uses the autograd engine's own path, which supports
            ``create_graph=True``.

    The model owns its replica threads: :meth:`close` ends them (and the auto-balancer's
    optimizer hook) at once; garbage collection does the same. It reports the phases of each step
    and each replica's work to the listeners attached with :meth:`add_listener` (the profiler and
    the memory tracker attach themselves for their duration), and to nobody else. A DataParallel
    may run inside another one's forward (a teacher model); wrapping a wrapper is refused
    (``ConfigError``).

    Raises:
        ConfigError: an option outside what it accepts, or ``module`` already a DataParallel/DDP.
        DeviceError: devices or ``output_device`` that do not parse or are not there.

    Example:
        >>> model = DataParallel(nn.Linear(8, 2), devices="cpu:2")
        >>> model(torch.randn(64, 8)).shape
        torch.Size([64, 2])
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | str | torch.device] | None = None,
        output_device: int | str | torch.device | None = None,
        dim: int = 0,
        *,
        devices: DeviceSpec = None,
        chunk_sizes: Sequence[float] | str | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        loss_reduction: ScalarRule | None = None,
        gather_outputs: bool = True,
        scalar_outputs: ScalarRule = "mean",
        parallel_backward: bool = True,
    ) -> None:
        super().__init__()
        _refuse_wrapper(module)
        if device_ids is not None and devices is not None:
            raise ConfigError("pass device_ids or devices, not both; devices accepts every form device_ids does")
        message = "scalar_outputs={value!r} is not one of {choices}; pass one of them ('mean': the replicas' mean)"
        lookup(dict.fromkeys(_SCALAR_RULES), scalar_outputs, message, choices=_SCALAR_RULES)
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ConfigError(f"dim={dim!r} must be an int: the batch dimension (negative counts from the last)")
        self.module = module
        self.replica_devices: list[ReplicaDevice] = parse_devices(devices if device_ids is None else device_ids)
        self.device_ids = [d.device.index for d in self.replica_devices]
        self.src_device_obj = self.replica_devices[0].device
        self.output_device = parse_output_device(output_device, self.src_device_obj)
        self.dim = dim
        auto = isinstance(chunk_sizes, str) and chunk_sizes == "auto"
        self.chunk_policy = build_policy(None if auto else chunk_sizes, len(self.replica_devices))
        if chunk_sizes is None:
            _check_balance(self.replica_devices)
        self.balancer = AutoBalancer(self.replica_devices, module) if auto else None
        self.loss_fn = loss_fn
        self.loss_reduction: ScalarRule = _loss_reduction(loss_fn, loss_reduction)
        self.gather_outputs = gather_outputs
        self.scalar_outputs: ScalarRule = scalar_outputs
        self.parallel_backward = parallel_backward
        self.replica_outputs: list[Any] = []
        self._primary_label = self.replica_devices[0].label
        self._param_bytes_cache: int | None = None
        self._listeners = Listeners()
        self._own_threads()
        self._register_state_dict_hook(drop_module_prefix)
        self._register_load_state_dict_pre_hook(add_module_prefix, with_module=True)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if (
            len(self.replica_devices) == 1
            and self.gather_outputs
            and _already_there(inputs, kwargs, self.src_device_obj)
        ):
            # One device, nothing to move or split: the module called as it is, without a walk of the
            # inputs (what a bare module costs; the general path below would move them first).
            return self.module(*inputs, **kwargs)
        target = self._pop_target(kwargs)
        owns_loss = target is not None
        # The one walk of the inputs: every later stage (batch size, split, moves) loops over these leaves.
        flat = flatten((inputs, kwargs, target))
        if len(self.replica_devices) == 1 and not owns_loss and self.gather_outputs:
            # nn.DataParallel's one-device path: the inputs moved to the device, the module called as it is
            if any(t.device != self.src_device_obj for t in flat.tensors()):
                inputs, kwargs, _ = flat.rebuild([_to(leaf, self.src_device_obj) for leaf in flat.leaves])
            return self.module(*inputs, **kwargs)
        self._check_placement()
        batch = batch_size(flat, self.dim)
        if batch is None:  # nothing to split: the primary replica runs alone, like nn.DataParallel
            return self._combine([flatten(self._run_one(self.module, inputs, kwargs, target))], [1], owns_loss)
        return self._step(flat, self._chunk_sizes(batch, flat))

    def close(self) -> None:
        """Release what this model holds outside itself: its replica threads and, with
        ``chunk_sizes="auto"``, the process-wide optimizer hook. Done by itself when the model is
        garbage-collected; call it to release them now. The model stays usable (its calls then
        start threads that end after each step)."""
        self._finalizer()

    def add_listener(self, listener: Listener) -> ListenerHandle:
        """Report this model's phases and replica scopes to ``listener`` until the handle is removed.

        Args:
            listener: an object with ``begin(name, device)``/``end(token, nbytes)`` (phases of each
                step, see :data:`multigpu.core.listeners.PHASES`) and/or ``replica_scope(label, device)``
                (a context entered on each replica's thread around its work).

        Returns:
            A handle: ``handle.remove()``, or use it as a context manager.

        Example:
            >>> with model.add_listener(profiler):      # doctest: +SKIP
            ...     model(x)
        """
        return self._listeners.add(listener)

    def _own_threads(self) -> None:
        # The finalizer holds the pool and the balancer, never the model, so the model can be collected.
        self._threads = ReplicaThreads()
        self._finalizer = weakref.finalize(self, _release, self._threads, self.balancer)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # a copy (deepcopy, pickle) gets threads and a finalizer of its own,
        del state["_threads"], state["_finalizer"], state["_listeners"]  # and nobody listening to it yet
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if self.balancer is not None:
            self.balancer.attach(self.module)
        self._listeners = Listeners()
        self._own_threads()

    @property
    def balance_plans(self) -> dict[int, BalancePlan]:
        """The auto-balance plans made so far, by batch size (empty unless ``chunk_sizes="auto"``)."""
        return dict(self.balancer.plans) if self.balancer else {}

    def _step(self, flat: Flat, sizes: list[int]) -> Any:
        """One step on the flattened ``(inputs, kwargs, target)``: split, replicate, run, gather."""
        active = [dev for dev, size in zip(self.replica_devices, sizes) if size > 0]
        with self._listeners.phase("scatter", self._primary_label, nbytes=self._nbytes(flat.leaves)):
            rows = split_inputs(flat, sizes, self.replica_devices, self.dim)
        if active == self.replica_devices[:1]:  # one chunk, on the primary: no replica needed
            with self._listeners.phase("forward", active[0].label):
                outputs = [flatten(self._run_one(self.module, *flat.rebuild(rows[0])))]
        elif self.parallel_backward and self._needs_grad(flat):
            outputs = self._forward_parallel_backward(flat, rows, active)
        else:
            with self._listeners.phase("replicate", self._primary_label, nbytes=self._param_bytes(len(active))):
                replicas = build_replicas(self.module, [d.device for d in active], detach=False)
            outputs = self._run_replicas(replicas.modules, [flat.rebuild(row) for row in rows], active)
        return self._combine(outputs, [s for s in sizes if s > 0], _target_of(flat) is not None)

    def _forward_parallel_backward(self, flat: Flat, rows: list[list[Any]], active: list[ReplicaDevice]) -> list[Flat]:
        with self._listeners.phase("replicate", self._primary_label, nbytes=self._param_bytes(len(active))):
            replicas = build_replicas(self.module, [d.device for d in active], detach=True)
        trainable = [j for j, p in enumerate(replicas.params) if p.requires_grad]
        sources: list[torch.Tensor] = []
        chunks: list[Any] = []
        input_leaves: list[list[torch.Tensor]] = []
        for row in rows:
            leaves: list[torch.Tensor] = []
            chunks.append(flat.rebuild([_as_leaf(leaf, sources, leaves) for leaf in row]))
            input_leaves.append(leaves)
        outputs = self._run_replicas(replicas.modules, chunks, active)
        graphs = [
            backward.ReplicaGraph(
                outputs=[t for t in out.tensors() if t.requires_grad],
                param_leaves=[replicas.leaves[i][j] for j in trainable],
                input_leaves=input_leaves[i],
            )
            for i, out in enumerate(outputs)
        ]
        if not any(g.outputs for g in graphs):
            return outputs
        params = [replicas.params[j] for j in trainable]
        turns = backward_turns(self.module, [d.device for d in active])
        plan = backward.BackwardPlan(graphs, active, self.src_device_obj, params, self._threads, self._listeners, turns)
        connected = iter(backward.connect(plan, sources))
        return [
            out.replace(lambda t: next(connected) if isinstance(t, torch.Tensor) and t.requires_grad else t)
            for out in outputs
        ]

    def _run_replicas(self, modules: list[nn.Module], chunks: list[Any], devices: list[ReplicaDevice]) -> list[Flat]:
        """Every replica's forward (and loss), in parallel, each inside the listeners' phase and scope;
        each result flattened once, on its replica's thread. CPU replicas whose forward draws random
        numbers take turns (:mod:`multigpu.parallel.random_turns`)."""
        turns = forward_turns(self.module, [d.device for d in devices])

        def run(i: int) -> Flat:
            with in_turn(turns, i), self._listeners.phase("forward", devices[i].label):
                return flatten(self._run_one(modules[i], *chunks[i]))

        return run_replicas(run, devices, self._threads, listeners=self._listeners)

    def _run_one(self, module: nn.Module, inputs: Any, kwargs: dict[str, Any], target: Any) -> Any:
        """One replica's work: forward, and the loss of its chunk when DataParallel owns the loss."""
        output = module(*inputs, **kwargs)
        if self.loss_fn is None or target is None:
            return output
        return (self.loss_fn(output, target), output)

    def _combine(self, outputs: list[Flat], sizes: list[int], owns_loss: bool) -> Any:
        """Gather what travels to the primary; keep the rest on the replicas.

        ``outputs``: each replica's result, flattened: its output, or ``(loss, output)`` when the
        model owns the loss."""
        if owns_loss:
            self.replica_outputs = [out.child(1).replace(_detach).rebuild() for out in outputs]
            outputs = [out.child(0) for out in outputs]
            rule = self.loss_reduction
        elif not self.gather_outputs:
            self.replica_outputs = [out.replace(_detach).rebuild() for out in outputs]
            outputs = [out.replace(_scalar_or_none) for out in outputs]
            rule = self.scalar_outputs
        else:
            rule = self.scalar_outputs
        moved = self._nbytes(leaf for out in outputs for leaf in out.leaves)
        with self._listeners.phase("gather", self._primary_label, nbytes=moved):
            return merge_outputs(outputs, sizes, self.output_device, self.dim, rule)

    def _chunk_sizes(self, batch: int, flat: Flat) -> list[int]:
        if self.balancer is not None:
            probe = partial(self._probe_step, flat)
            planned = self.balancer.sizes(batch, probe, self, self._listeners)
            if planned is not None:
                return planned
        return self.chunk_policy.sizes(batch)

    def _probe_step(self, flat: Flat, sizes: list[int]) -> None:
        """Forward and backward of the real batch for the auto-balance probe (see balance.py)."""
        inputs = len(flat.leaves) - len(flat.child(2).leaves)  # the target's leaves are last
        detached = [_detach(leaf) for leaf in flat.leaves[:inputs]] + flat.leaves[inputs:]
        result = self._step(Flat(detached, flat.spec), sizes)
        scalars = [t for t in iter_tensors(result) if t.dim() == 0 and t.requires_grad]
        if scalars:
            loss = torch.stack([s.float() for s in scalars]).sum()
        else:  # the user's criterion runs on the gathered outputs: stand in for it
            outs = [t for t in iter_tensors(result) if t.requires_grad and t.is_floating_point()]
            if not outs:
                return
            loss = torch.stack([(t * t).sum().float() for t in outs]).sum()
        loss.backward()

    def _pop_target(self, kwargs: dict[str, Any]) -> Any:
        """The targets of ``model(x, target=y)`` when DataParallel owns the loss; None otherwise.

        Without ``loss_fn`` a ``target=`` goes to the module's forward, as every kwarg does in
        nn.DataParallel, unless that forward cannot take it: then the caller meant ``loss_fn=``.
        """
        if self.loss_fn is None:
            if "target" in kwargs and not _takes_keyword(getattr(self.module.forward, "__func__", None), "target"):
                raise ConfigError(
                    f"model(..., target=...) needs loss_fn=: {type(self.module).__name__}.forward takes no "
                    "target argument, and DataParallel computes the loss on the replicas only when given one, "
                    "e.g. multigpu.DataParallel(net, loss_fn=nn.CrossEntropyLoss()); or call loss_fn(model(x), y)"
                )
            return None
        return kwargs.pop("target", None)

    def _param_bytes(self, replicas: int) -> int:
        """Bytes the parameter broadcast moves: every parameter to every replica (0 when not profiling)."""
        if not self._listeners.active:
            return 0
        if self._param_bytes_cache is None:  # parameters keep their sizes: walk them once
            self._param_bytes_cache = sum(p.numel() * p.element_size() for p in self.module.parameters())
        return replicas * self._param_bytes_cache

    def _nbytes(self, leaves: Iterable[Any]) -> int:
        """Bytes of every tensor in ``leaves`` (0 when not profiling)."""
        if not self._listeners.active:
            return 0
        return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))

    def _needs_grad(self, flat: Flat) -> bool:
        if not torch.is_grad_enabled():
            return False
        if any(t.requires_grad for t in chain(self.module.parameters(), self.module.buffers())):
            return True
        inputs = len(flat.leaves) - len(flat.child(2).leaves)  # the target does not count
        return any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat.leaves[:inputs])

    def _check_placement(self) -> None:
        for name, tensor in chain(self.module.named_parameters(), self.module.named_buffers()):
            if tensor.device != self.src_device_obj:
                raise PlacementError(  # torch's sentence first: code written for nn.DataParallel matches it
                    f"module must have its parameters and buffers on device {self.src_device_obj} "
                    f"(the primary device, {self.replica_devices[0].label}): module parameter or buffer {name!r} "
                    f"is on {tensor.device}; move the model first: model.to({str(self.src_device_obj)!r})"
                )

    def extra_repr(self) -> str:
        labels = ", ".join(d.label for d in self.replica_devices)
        return f"devices=[{labels}], output_device={self.output_device}, dim={self.dim}"


@lru_cache(maxsize=64)
def _takes_keyword(forward: Callable[..., Any] | None, name: str) -> bool:
    """Whether ``forward`` accepts ``name=`` (a parameter of that name, or ``**kwargs``); unknown: yes."""
    if forward is None:  # a forward that is no plain method (set on the instance): do not guess
        return True
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): do not guess
        return True
    return any(p.kind is p.VAR_KEYWORD or (p.name == name and p.kind is not p.POSITIONAL_ONLY) for p in parameters)


def _loss_reduction(loss_fn: Any, given: ScalarRule | None) -> ScalarRule:
    reduction = given or getattr(loss_fn, "reduction", None) or "mean"
    lookup(
        dict.fromkeys(_REDUCTIONS),
        reduction,
        "loss reduction {value!r} cannot be combined across replicas, only {choices}; use a criterion with "
        "reduction='mean' or 'sum', or pass loss_reduction='mean'/'sum'",
    )
    return reduction  # type: ignore[no-any-return]


def _target_of(flat: Flat) -> Any:
    """The target of a flattened ``(inputs, kwargs, target)`` (None when there is none)."""
    return flat.child(2).rebuild()


def _detach(leaf: Any) -> Any:
    return leaf.detach() if isinstance(leaf, torch.Tensor) else leaf


def _scalar_or_none(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
        return None
    return leaf


def _as_leaf(leaf: Any, sources: list[torch.Tensor], leaves: list[torch.Tensor]) -> Any:
    """Replace a differentiable input chunk by a leaf, remembering both (for the boundary)."""
    if not isinstance(leaf, torch.Tensor) or not leaf.requires_grad:
        return leaf
    made = leaf.detach().requires_grad_(True)
    sources.append(leaf)
    leaves.append(made)
    return made


def _refuse_wrapper(module: nn.Module) -> None:
    if not isinstance(module, nn.Module):
        raise ConfigError(
            f"module must be a torch.nn.Module, got {type(module).__name__}; wrap the callable in a Module "
            "whose forward calls it (its parameters, if any, registered on that Module)"
        )
    if isinstance(module, (DataParallel, nn.DataParallel, DistributedDataParallel)):
        raise ConfigError(
            f"module is already a {type(module).__name__}; wrapping it again would split every chunk a "
            "second time. Wrap the bare model instead: DataParallel(model.module, ...) "
            "(multigpu.unwrap(model) returns it). A DataParallel inside the model, such as a teacher "
            "called in forward, is fine"
        )


def _check_balance(devices: Sequence[ReplicaDevice]) -> None:
    """nn.DataParallel's imbalance warning, pointing at chunk_sizes='auto' (accelerators only)."""
    capacities = [get_device_type(d.type).capacity(d.device) for d in devices]
    if len(devices) < 2 or any(c is None for c in capacities):
        return
    message = imbalance_warning([d.label for d in devices], [c for c in capacities if c is not None])
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=3)


def _release(threads: ReplicaThreads, balancer: AutoBalancer | None) -> None:
    threads.close()
    if balancer is not None:
        balancer.close()


_PLAIN = (int, float, bool, str, type(None))


def _already_there(inputs: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device) -> bool:
    """Whether every argument is a plain tensor on ``device`` or a plain scalar (no container to walk),
    and no ``target=`` (which the loss path, or its refusal, must see)."""
    if "target" in kwargs:
        return False
    for value in chain(inputs, kwargs.values()):
        if type(value) is torch.Tensor:
            if value.device != device:
                return False
        elif not isinstance(value, _PLAIN):
            return False
    return True


def _to(leaf: Any, device: torch.device) -> Any:
    return leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf
