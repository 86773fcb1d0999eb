"""Per-device memory accounting against tensors of known size."""

from __future__ import annotations

import torch
from torch import nn

import multigpu
from multigpu.profiling.memory import track_memory

WIDTH = 1024  # floats per sample: 4 KiB


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w  # allocates exactly the chunk's size


def test_inference_figures_are_exact() -> None:
    model = multigpu.DataParallel(Scale(), devices="cpu:3", chunk_sizes=[2, 3, 5])
    x = torch.randn(10, WIDTH)
    with torch.no_grad(), track_memory(model) as mem:
        model(x)
    got = {m.label: m for m in mem.results()}
    row, params = WIDTH * 4, WIDTH * 4
    assert [got[k].activations for k in ("cpu:0", "cpu:1", "cpu:2")] == [2 * row, 3 * row, 5 * row]
    assert got["cpu:0"].gathered == 10 * row  # the gathered output lives on the primary only
    assert got["cpu:1"].gathered == got["cpu:2"].gathered == 0
    assert all(m.resident == params for m in got.values())
    assert got["cpu:0"].peak == params + 12 * row  # replica output and gathered copy, alive together
    assert got["cpu:2"].peak == params + 5 * row


def test_resident_counts_gradients_and_optimizer_state_on_the_primary() -> None:
    net = Scale()
    optimizer = torch.optim.Adam(net.parameters())
    model = multigpu.DataParallel(net, devices="cpu:2")
    model(torch.randn(4, WIDTH)).sum().backward()
    optimizer.step()
    with track_memory(model, optimizer) as mem:
        pass
    primary, other = mem.results()
    # parameters + gradients + Adam's exp_avg and exp_avg_sq (the 'step' counters are tiny)
    assert primary.resident - WIDTH * 4 * 4 < 64
    assert other.resident == WIDTH * 4


def test_loss_on_the_replicas_removes_the_gathered_outputs() -> None:
    def run(**kwargs: object) -> tuple[float, int]:
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4096))
        model = multigpu.DataParallel(net, devices="cpu:2", **kwargs)  # type: ignore[arg-type]
        x, y = torch.randn(32, 8), torch.randint(0, 4096, (32,))
        model(x[:2], target=y[:2]) if kwargs else model(x[:2])  # warm-up outside the measured step
        with track_memory(model) as mem:
            loss = model(x, target=y) if kwargs else nn.functional.cross_entropy(model(x), y)
            loss.backward()
        return mem.primary_ratio(), mem.results()[0].gathered

    standard_ratio, standard_gathered = run()
    replica_ratio, replica_gathered = run(loss_fn=nn.CrossEntropyLoss())
    assert standard_ratio > 1.5
    assert standard_gathered >= 32 * 4096 * 4  # at least the gathered logits
    assert replica_gathered < 4096 * 4  # scalars only
    assert replica_ratio < standard_ratio
