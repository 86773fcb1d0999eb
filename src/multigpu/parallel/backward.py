"""Parallel backward: run each replica's backward in its own thread, then sum onto the primary.

Why: on CPU the autograd engine runs backward on the thread that called ``loss.backward()``, so
replicas that ran their forward in parallel would run their backward one after another (on CUDA
the engine has a thread per device and overlaps them by itself). Here each replica computes on
*leaf* copies of the parameters and inputs (see :mod:`multigpu.parallel.replicas`); the
replica outputs enter the caller's graph through :class:`_ReplicaBoundary`, whose backward
calls ``torch.autograd.backward`` on every replica's own graph in a replica thread, then sums
the leaves' gradients onto the primary's parameters and returns the inputs' gradients.

Gradients equal the single-device ones; ``create_graph=True`` (higher-order gradients) needs the
engine path instead (``DataParallel(..., parallel_backward=False)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from multigpu.core import comm
from multigpu.core.listeners import Listeners
from multigpu.devices import ReplicaDevice, common_type
from multigpu.parallel.random_turns import Turns, in_turn
from multigpu.parallel.threads import ReplicaThreads, run_replicas


@dataclass
class ReplicaGraph:
    """What one replica's backward needs: its outputs (with graph) and its leaves."""

    outputs: list[torch.Tensor]  # the replica's differentiable outputs, in flat order
    param_leaves: list[torch.Tensor]  # aligned with the primary's parameters
    input_leaves: list[torch.Tensor]  # the leaves made from this replica's input chunks


@dataclass
class BackwardPlan:
    """Everything the boundary's backward needs for one step."""

    graphs: list[ReplicaGraph]
    devices: list[ReplicaDevice]
    primary: torch.device
    params: list[torch.Tensor]  # the primary's trainable parameters (and buffers that require grad)
    threads: ReplicaThreads  # the owner's pool: the replicas' backward runs on it
    listeners: Listeners  # the owner's: they hear the backward and reduce phases
    turns: Turns | None = None  # CPU replicas whose backward recomputes random draws go one at a time

    def run(self, output_grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Backward of every replica in parallel; returns grads for params, then for every input leaf."""
        offsets = _offsets([len(g.outputs) for g in self.graphs])

        def backward_one(i: int) -> None:
            graph = self.graphs[i]
            pairs = [
                (out, grad)
                for out, grad in zip(graph.outputs, output_grads[offsets[i] : offsets[i + 1]])
                if grad is not None
            ]
            with in_turn(self.turns, i):  # entered with or without gradients: the next replica waits on it
                if pairs:
                    outs, grads = zip(*pairs)
                    with self.listeners.phase("backward", self.devices[i].label):
                        torch.autograd.backward(list(outs), list(grads))

        run_replicas(backward_one, self.devices, self.threads, what="backward", listeners=self.listeners)
        leaf_grads = [[leaf.grad for leaf in g.param_leaves] for g in self.graphs]
        moved = (
            sum(t.numel() * t.element_size() for row in leaf_grads for t in row if t is not None)
            if self.listeners.active
            else 0
        )
        fast = common_type([d.device for d in self.devices])  # coalesced reduce where the type has one (CUDA)
        with self.listeners.phase("reduce", self.devices[0].label, nbytes=moved):
            param_grads = comm.reduce_add(leaf_grads, self.primary, fast)
        input_grads = [leaf.grad for g in self.graphs for leaf in g.input_leaves]
        return [*param_grads, *input_grads]


class _ReplicaBoundary(torch.autograd.Function):
    """Identity on the replica outputs whose backward is :meth:`BackwardPlan.run`.

    Inputs: (plan, n_sources, *sources, *outputs) where sources are the primary's parameters
    followed by the differentiable input chunks the leaves were made from.
    """

    @staticmethod
    def forward(ctx: Any, plan: BackwardPlan, n_sources: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.plan = plan
        ctx.n_sources = n_sources
        # Outputs nobody differentiates (a replica's logits when only its loss is used) get None,
        # not an output-sized tensor of zeros.
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors[n_sources:])

    @staticmethod
    def backward(ctx: Any, *output_grads: torch.Tensor | None) -> tuple[Any, ...]:
        plan: BackwardPlan | None = ctx.plan
        if plan is None or torch.is_grad_enabled():
            raise RuntimeError(
                "backward ran through DataParallel's parallel backward "
                + ("a second time (retain_graph=True)" if plan is None else "with create_graph=True")
                + ", which it does not support; build the model with "
                "multigpu.DataParallel(..., parallel_backward=False) for higher-order or repeated backward"
            )
        ctx.plan = None  # free the replica graphs as soon as they have run
        source_grads = plan.run(output_grads)
        return (None, None, *source_grads, *([None] * len(output_grads)))


def connect(plan: BackwardPlan, input_sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Put the replica outputs into the caller's graph; returns them, in flat order, with grad_fn."""
    outputs = [out.detach() for g in plan.graphs for out in g.outputs]
    sources = [*plan.params, *input_sources]
    return list(_ReplicaBoundary.apply(plan, len(sources), *sources, *outputs))


def _offsets(lengths: Sequence[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out
