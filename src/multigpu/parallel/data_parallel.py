"""``multigpu.DataParallel``: nn.DataParallel's one line, on any device, with the fixes.

One step: scatter the inputs on ``dim`` -> replicate the module from the primary device ->
run the replicas in parallel threads -> gather the outputs on ``output_device``. After
``loss.backward()`` the primary module's ``.grad`` equals the single-device gradient of the same
batch. What it keeps from nn.DataParallel and what it fixes is listed in the README.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn

from multigpu.checkpoint.keys import strip_prefixes
from multigpu.devices import DeviceSpec, ReplicaDevice, parse_devices
from multigpu.errors import ConfigError, PlacementError
from multigpu.parallel import backward
from multigpu.parallel.chunks import build_policy
from multigpu.parallel.parallel_apply import parallel_apply
from multigpu.parallel.replicate import replicate
from multigpu.parallel.scatter_gather import ScalarRule, batch_size, gather, scatter
from multigpu.parallel.structure import iter_tensors, map_leaves
from multigpu.profiling import phases
from multigpu.profiling.phases import phase

_SCALAR_RULES = ("mean", "sum", "stack")


class DataParallel(nn.Module):
    """Split each batch across devices, run a replica of ``module`` on each, gather the outputs.

    Args:
        module: the model, with its parameters and buffers on the primary device.
        device_ids: accelerator indices, as in nn.DataParallel (``[0, 1]``).
        output_device: where outputs are gathered (default: the primary device).
        dim: the batch dimension of inputs and outputs.
        devices: any devices instead of ``device_ids``: ``"cpu:2"``, ``"cuda:0,1"``,
            ``["cuda:0", "cuda:1"]``. Default (neither given): every visible GPU, else the CPU.
        chunk_sizes: how to split the batch: ``None`` (even), ints summing to the batch
            (``[24, 40]``) or float weights (``[0.4, 0.6]``).
        scalar_outputs: how 0-dim outputs (a loss per replica) combine: ``"mean"`` weights by
            chunk size (equals a mean-reduced loss over the batch), ``"sum"``, or ``"stack"``
            (nn.DataParallel's vector of per-replica values).
        parallel_backward: run each replica's backward in its own thread (needed for CPU
            replicas to overlap). ``False`` uses the autograd engine's own path, which supports
            ``create_graph=True``.

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
        chunk_sizes: Sequence[float] | None = None,
        scalar_outputs: ScalarRule = "mean",
        parallel_backward: bool = True,
    ) -> None:
        super().__init__()
        if device_ids is not None and devices is not None:
            raise ConfigError("pass device_ids or devices, not both; devices accepts every form device_ids does")
        if scalar_outputs not in _SCALAR_RULES:
            raise ConfigError(f"scalar_outputs={scalar_outputs!r} is not one of {_SCALAR_RULES}")
        if dim < 0:
            raise ConfigError(f"dim={dim} must be >= 0 (the batch dimension counted from the front)")
        self.module = module
        self.replica_devices: list[ReplicaDevice] = parse_devices(devices if device_ids is None else list(device_ids))
        self.device_ids = [d.device.index for d in self.replica_devices]
        self.src_device_obj = self.replica_devices[0].device
        self.output_device = _output_device(output_device, self.src_device_obj)
        self.dim = dim
        self.chunk_policy = build_policy(chunk_sizes, len(self.replica_devices))
        self.scalar_outputs: ScalarRule = scalar_outputs
        self.parallel_backward = parallel_backward
        self._register_state_dict_hook(_drop_module_prefix)
        self._register_load_state_dict_pre_hook(_add_module_prefix)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if len(self.replica_devices) == 1:
            return self.module(*inputs, **kwargs)
        self._check_placement()
        batch = batch_size((inputs, kwargs), self.dim)
        if batch is None:  # nothing to split: the primary replica runs alone, like nn.DataParallel
            return self.module(*inputs, **kwargs)
        sizes = self.chunk_policy.sizes(batch)
        active = [dev for dev, size in zip(self.replica_devices, sizes) if size > 0]
        with phase("scatter", nbytes=_nbytes((inputs, kwargs))):
            chunks = scatter((inputs, kwargs), sizes, self.replica_devices, self.dim)
        active_sizes = [s for s in sizes if s > 0]
        if len(active) == 1:
            with phase("forward", active[0].label):
                outputs = [self.module(*chunks[0][0], **chunks[0][1])]
        elif self.parallel_backward and self._needs_grad(inputs, kwargs):
            outputs = self._forward_parallel_backward(chunks, active)
        else:
            with phase("replicate", nbytes=self._param_bytes(len(active))):
                replicas = replicate(self.module, [d.device for d in active], detach=False)
            outputs = parallel_apply(_forward_fn(replicas.modules, chunks, active), active)
        with phase("gather", nbytes=_nbytes(outputs)):
            return gather(outputs, active_sizes, self.output_device, self.dim, self.scalar_outputs)

    def _forward_parallel_backward(self, chunks: list[Any], active: list[ReplicaDevice]) -> list[Any]:
        with phase("replicate", nbytes=self._param_bytes(len(active))):
            replicas = replicate(self.module, [d.device for d in active], detach=True)
        trainable = [j for j, p in enumerate(replicas.params) if p.requires_grad]
        sources: list[torch.Tensor] = []
        leaf_chunks: list[Any] = []
        input_leaves: list[list[torch.Tensor]] = []
        for chunk in chunks:
            leaves: list[torch.Tensor] = []
            leaf_chunks.append(map_leaves(lambda leaf, _: _as_leaf(leaf, sources, leaves), chunk))
            input_leaves.append(leaves)
        outputs = parallel_apply(_forward_fn(replicas.modules, leaf_chunks, active), active)
        graphs = [
            backward.ReplicaGraph(
                outputs=[t for t in iter_tensors(out) if t.requires_grad],
                param_leaves=[replicas.leaves[i][j] for j in trainable],
                input_leaves=input_leaves[i],
            )
            for i, out in enumerate(outputs)
        ]
        plan = backward.BackwardPlan(
            graphs=graphs,
            devices=active,
            primary=self.src_device_obj,
            params=[replicas.params[j] for j in trainable],
        )
        if not any(g.outputs for g in graphs):
            return outputs
        connected = iter(backward.connect(plan, sources))
        return [
            map_leaves(lambda t, _: next(connected) if isinstance(t, torch.Tensor) and t.requires_grad else t, out)
            for out in outputs
        ]

    def _param_bytes(self, replicas: int) -> int:
        """Bytes the parameter broadcast moves: every parameter to every replica (0 when not profiling)."""
        if not phases.active():
            return 0
        return replicas * sum(p.numel() * p.element_size() for p in self.module.parameters())

    def _needs_grad(self, inputs: Any, kwargs: Any) -> bool:
        if not torch.is_grad_enabled():
            return False
        if any(p.requires_grad for p in self.module.parameters()):
            return True
        return any(t.requires_grad for t in iter_tensors((inputs, kwargs)))

    def _check_placement(self) -> None:
        for name, tensor in chain(self.module.named_parameters(), self.module.named_buffers()):
            if tensor.device != self.src_device_obj:
                raise PlacementError(
                    f"module parameter or buffer {name!r} is on {tensor.device}, but DataParallel's primary "
                    f"device is {self.replica_devices[0].label}; move the model first: "
                    f"model.to({str(self.src_device_obj)!r})"
                )

    def extra_repr(self) -> str:
        labels = ", ".join(d.label for d in self.replica_devices)
        return f"devices=[{labels}], output_device={self.output_device}, dim={self.dim}"


def _nbytes(obj: Any) -> int:
    """Bytes of every tensor in ``obj`` (0 when not profiling: counting costs a walk)."""
    if not phases.active():
        return 0
    return sum(t.numel() * t.element_size() for t in iter_tensors(obj))


def _forward_fn(modules: list[nn.Module], chunks: list[Any], devices: list[ReplicaDevice]) -> Any:
    def run(i: int) -> Any:
        args, kwargs = chunks[i]
        with phase("forward", devices[i].label):
            return modules[i](*args, **kwargs)

    return run


def _as_leaf(leaf: Any, sources: list[torch.Tensor], leaves: list[torch.Tensor]) -> Any:
    """Replace a differentiable input chunk by a leaf, remembering both (for the boundary)."""
    if not isinstance(leaf, torch.Tensor) or not leaf.requires_grad:
        return leaf
    made = leaf.detach().requires_grad_(True)
    sources.append(leaf)
    leaves.append(made)
    return made


def _output_device(spec: int | str | torch.device | None, primary: torch.device) -> torch.device:
    if spec is None:
        return primary
    if isinstance(spec, int):
        return torch.device(primary.type, spec)
    device = torch.device(spec)
    return torch.device("cpu") if device.type == "cpu" else device


def _drop_module_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """state_dict hook: save the wrapped module's keys without the ``module.`` segment."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _add_module_prefix(state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """load_state_dict pre-hook: accept bare, ``module.`` and ``_orig_mod.`` keys alike."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[prefix + "module." + strip_prefixes(key[len(prefix) :])] = state_dict.pop(key)
