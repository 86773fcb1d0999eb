"""Moving tensors between replica devices (multigpu.core.comm), on CPU devices."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from multigpu.core import comm


class _FirstDeviceKeepsTheInputs:
    """Coalesced copies as torch.cuda.comm.broadcast_coalesced returns them: for ``devices[0]``, the
    input tensors themselves (torch/csrc/cuda/comm.cpp: ``outputs[0] = tensors.vec()``), fresh
    copies for the others. CPU "devices" stand in for the GPUs; the code under test is comm's."""

    def broadcast_coalesced(
        self, tensors: Sequence[torch.Tensor], devices: Sequence[torch.device]
    ) -> list[list[torch.Tensor]] | None:
        return [list(tensors)] + [[t.clone() for t in tensors] for _ in devices[1:]]

    def reduce_add_coalesced(
        self, per_replica: Sequence[Sequence[torch.Tensor]], destination: torch.device
    ) -> list[torch.Tensor] | None:
        return None


def test_each_replica_gets_leaves_of_its_own_when_a_device_repeats() -> None:
    """Shared leaf objects would let two replicas' backward accumulate into one ``.grad``, which the
    reduction then counts twice (the parameter gradient doubled)."""
    params = [torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)]
    cpu = torch.device("cpu")
    for fast in (None, _FirstDeviceKeepsTheInputs()):
        copies = comm.broadcast_detached(params, [cpu, cpu, cpu], fast)
        assert len(copies) == 3
        for j, param in enumerate(params):
            leaves = [row[j] for row in copies]
            assert len({id(leaf) for leaf in leaves}) == 3, "a leaf object is shared between replicas"
            assert all(leaf.data_ptr() == param.data_ptr() for leaf in leaves)  # same device: same storage
            assert all(not leaf.requires_grad and leaf.grad_fn is None for leaf in leaves)
