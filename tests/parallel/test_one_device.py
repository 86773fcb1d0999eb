"""DataParallel on one device costs what the bare module costs: the module is called as it is, with
the caller's own tensors, and every semantic of the wrapper still holds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import multigpu
from multigpu.errors import ConfigError


class Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.seen: list[tuple[object, ...]] = []

    def forward(self, x: torch.Tensor, scale: float = 1.0, mask: torch.Tensor | None = None) -> torch.Tensor:
        self.seen.append((x, scale, mask))
        out = self.lin(x) * scale
        return out if mask is None else out * mask


def test_the_module_gets_the_callers_tensors_and_the_one_device_gradient() -> None:
    torch.manual_seed(0)
    bare = Recorder()
    wrapped = multigpu.DataParallel(Recorder(), devices="cpu")
    wrapped.module.load_state_dict(bare.state_dict())
    x, mask = torch.randn(5, 4), torch.ones(5, 3)
    out = wrapped(x, 2.0, mask=mask)
    assert wrapped.module.seen[-1][0] is x and wrapped.module.seen[-1][2] is mask  # nothing copied or moved
    torch.testing.assert_close(out, bare(x, 2.0, mask=mask), rtol=0, atol=0)
    out.sum().backward()
    bare(x, 2.0, mask=mask).sum().backward()
    for a, b in zip(wrapped.module.parameters(), bare.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_nested_inputs_target_and_hooks_keep_the_wrappers_rules_on_one_device() -> None:
    wrapped = multigpu.DataParallel(Recorder(), devices="cpu")
    with pytest.raises(ConfigError, match="needs loss_fn="):
        wrapped(torch.randn(2, 4), target=torch.randn(2, 3))
    owned = multigpu.DataParallel(nn.Linear(4, 3), devices="cpu", loss_fn=nn.MSELoss())
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    torch.testing.assert_close(owned(x, target=y), nn.functional.mse_loss(owned.module(x), y))
    calls: list[int] = []
    wrapped.register_forward_hook(lambda *_: calls.append(1))
    wrapped(torch.randn(2, 4))
    assert calls == [1]
    seq = multigpu.DataParallel(nn.Sequential(nn.Linear(4, 3)), devices="cpu", gather_outputs=False)
    assert seq(torch.randn(2, 4)) is None and seq.replica_outputs[0].shape == (2, 3)
