"""The model vocabulary of the differential fuzzer (test_differential.py): one configurable network.

A :class:`Spec` picks a trunk (Linear, Conv1d/Conv2d with groups, Embedding with Long inputs,
GRU, LSTM), a norm (BatchNorm, LayerNorm), and the structures that have broken data-parallel
engines before: tied weights, a submodule used twice, a buffer that requires grad,
ParameterList/ParameterDict, an unused branch, frozen parameters, a DataParallel nested inside,
Dropout (drawn only for eval), kwargs (a per-sample tensor, a shared 0-dim tensor, a non-tensor),
and outputs as a tensor, dict, tuple, dataclass or a nested mix (with None and an integer tensor),
optionally with a 0-dim output. The batch may sit on any ``dim``: the network moves it to the
front on entry and back on exit.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import multigpu

WIDTH = 8
CLASSES = 3
VOCAB = 11
LENGTH = 5


@dataclass(frozen=True)
class Spec:
    trunk: str  # "linear" | "conv1d" | "conv2d" | "embedding" | "gru" | "lstm"
    groups: int  # conv groups (1, 2 or 4)
    norm: str  # "none" | "batch" (conv trunks only) | "layer"
    dropout: bool  # a Dropout(0.5) layer; drawn only for eval, where it is the identity
    tied: bool  # two Linear layers share one weight Parameter
    shared: bool  # one submodule called twice
    grad_buffer: bool  # a buffer that requires grad scales the features
    param_containers: bool  # ParameterList and ParameterDict entries take part
    unused: bool  # a branch whose parameters never see the forward
    output: str  # "tensor" | "dict" | "tuple" | "dataclass" | "nested"
    scalar: bool  # add a 0-dim output (a mean over the batch)
    kwargs: bool  # a per-sample mask, a shared 0-dim scale and a string flag
    nested: int = 0  # > 0: the shared block is itself a DataParallel over that many CPU replicas
    frozen: bool = False  # the trunk's parameters do not require grad

    @property
    def long_inputs(self) -> bool:
        return self.trunk in ("embedding", "gru", "lstm")

    def input_shape(self, batch: int) -> tuple[int, ...]:
        """The shape of one input with the batch first."""
        return {
            "linear": (batch, 6),
            "conv1d": (batch, 4, 7),
            "conv2d": (batch, 2, 5, 5),
        }.get(self.trunk, (batch, LENGTH))


@dataclass
class FuzzOut:
    logits: torch.Tensor
    hidden: torch.Tensor
    note: str


class FuzzNet(nn.Module):
    """The network a :class:`Spec` describes; ``dim`` is where inputs and outputs keep the batch."""

    def __init__(self, spec: Spec, dim: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.spec, self.dim = spec, dim
        self.trunk = _trunk(spec)
        self.norm = nn.LayerNorm(WIDTH) if spec.norm == "layer" else nn.Identity()
        self.drop = nn.Dropout(0.5) if spec.dropout else nn.Identity()
        self.block: nn.Module = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        if spec.nested:
            self.block = multigpu.DataParallel(self.block, devices=f"cpu:{spec.nested}")
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.proj2 = nn.Linear(WIDTH, WIDTH, bias=False)
        if spec.tied:
            self.proj2.weight = self.proj.weight
        if spec.param_containers:
            self.plist = nn.ParameterList([nn.Parameter(torch.randn(WIDTH) * 0.1) for _ in range(2)])
            self.pdict = nn.ParameterDict({"shift": nn.Parameter(torch.randn(WIDTH) * 0.1)})
        if spec.unused:
            self.unused = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)
        if spec.frozen:
            self.trunk.requires_grad_(False)
        self.to(dtype)  # before the buffer that requires grad: .to() would make it a non-leaf
        if spec.grad_buffer:
            self.register_buffer("gain", torch.linspace(0.5, 1.5, WIDTH, dtype=dtype).requires_grad_())

    def forward(
        self, x: torch.Tensor, *, mask: torch.Tensor | None = None, scale: torch.Tensor | None = None, flag: str = ""
    ) -> Any:
        h = _features(self.trunk, self.spec, x.movedim(self.dim, 0))
        h = self.drop(self.norm(h))
        if self.spec.grad_buffer:
            h = h * self.gain
        if self.spec.param_containers:
            h = h * (1 + self.plist[0]) + self.plist[1] + self.pdict["shift"]
        h = self.block(h)
        if self.spec.shared:
            h = self.block(h)
        h = self.proj2(torch.tanh(self.proj(h))) if self.spec.tied else self.proj(h)
        if mask is not None and scale is not None:
            h = h * mask.movedim(self.dim, 0) * scale + (0.5 if flag == "on" else 0.0)
        logits = self.head(h)
        pred = logits.argmax(-1, keepdim=True)  # an integer output, batch first like the others
        return self._structure(*(t.movedim(0, self.dim) for t in (logits, h, pred)))

    def _structure(self, logits: torch.Tensor, hidden: torch.Tensor, pred: torch.Tensor) -> Any:
        kind = self.spec.output
        if kind == "tensor":
            out: Any = logits
        elif kind == "dict":
            out = {"logits": logits, "hidden": hidden}
        elif kind == "tuple":
            out = (logits, hidden)
        elif kind == "dataclass":
            out = FuzzOut(logits, hidden, "same on every replica")
        else:
            out = {"out": (logits, {"hidden": hidden}), "count": 3, "none": None}
            if not torch.is_autocast_enabled("cpu"):  # bf16 near-ties could flip an argmax
                out["pred"] = pred
        if self.spec.scalar:
            out = (out, logits.to(torch.promote_types(logits.dtype, torch.float32)).pow(2).mean())
        return out


def _trunk(spec: Spec) -> nn.Module:
    if spec.trunk == "linear":
        return nn.Linear(6, WIDTH)
    if spec.trunk == "conv1d":
        norm: nn.Module = nn.BatchNorm1d(WIDTH) if spec.norm == "batch" else nn.Identity()
        return nn.Sequential(nn.Conv1d(4, WIDTH, 3, groups=spec.groups), norm, nn.ReLU())
    if spec.trunk == "conv2d":
        norm = nn.BatchNorm2d(WIDTH) if spec.norm == "batch" else nn.Identity()
        return nn.Sequential(nn.Conv2d(2, WIDTH, 3, groups=min(spec.groups, 2)), norm, nn.ReLU())
    embed = nn.Embedding(VOCAB, WIDTH)
    if spec.trunk == "embedding":
        return embed
    rnn = (nn.GRU if spec.trunk == "gru" else nn.LSTM)(WIDTH, WIDTH, batch_first=True)
    return nn.ModuleDict({"embed": embed, "rnn": rnn})


def _features(trunk: nn.Module, spec: Spec, x: torch.Tensor) -> torch.Tensor:
    """(batch, WIDTH) features from an input whose batch is on dim 0."""
    if spec.trunk == "linear":
        return trunk(x)
    if spec.trunk in ("conv1d", "conv2d"):
        return trunk(x).flatten(2).mean(-1)
    if spec.trunk == "embedding":
        return trunk(x).mean(1)
    seq, _ = trunk["rnn"](trunk["embed"](x))  # type: ignore[index]
    return seq[:, -1]


def one_device(net: FuzzNet) -> FuzzNet:
    """The oracle: a copy of ``net`` with any nested DataParallel replaced by its module."""
    ref = copy.deepcopy(net)
    if isinstance(ref.block, multigpu.DataParallel):
        inner = ref.block.module
        ref.block.close()
        ref.block = inner
    return ref
