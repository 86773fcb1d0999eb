"""Small real models for the tests: an MLP, a CNN with BatchNorm, and a tiny transformer LM
with a dataclass (ModelOutput-style, OrderedDict-based) output and a self-computed loss."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn


def mlp(width: int = 16, classes: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, classes))


class ModelOutput(OrderedDict):
    """OrderedDict-based dataclass output, shaped like transformers' ModelOutput."""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                self[f.name] = value


@dataclass
class LMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


class TinyLM(nn.Module):
    """A two-layer causal transformer language model that computes its own (mean) loss."""

    def __init__(self, vocab: int = 50, width: int = 32, heads: int = 4, layers: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(seq, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **_: Any) -> LMOutput:
        t = input_ids.size(1)
        hidden = self.blocks(self.embed(input_ids) + self.pos[:t], mask=self.mask[:t, :t], is_causal=True)
        logits = self.head(hidden)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return LMOutput(loss=loss, logits=logits, hidden=hidden)


def twin(factory: Any, *args: Any) -> tuple[nn.Module, nn.Module]:
    """Two identical models: one to wrap, one as the single-device oracle."""
    a = factory(*args)
    b = factory(*args)
    b.load_state_dict(a.state_dict())
    return a, b


def assert_same_grads(a: nn.Module, b: nn.Module, **tol: float) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if q.grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None, f"no gradient for {name}"
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}: {m}", **tol)  # noqa: B023 (called at once, inside this iteration)
