"""Differential fuzzer: multigpu.DataParallel against the same model on one device.

Hypothesis draws a model from the vocabulary of :mod:`tests.parallel.fuzz_models`, a batch size
(also smaller than the device count), 1-4 CPU replicas, ``chunk_sizes`` (None, ints, weights,
"auto"), the batch ``dim`` (0, 1, -1), both ``parallel_backward`` modes, both ``zero_grad`` modes,
1-3 accumulated micro-batches, bf16 autocast, train/eval mode, ``no_grad`` inference and the loss
on the replicas; then trains two optimizer steps (SGD with momentum) and compares outputs, loss,
every gradient (parameters, a buffer that requires grad, the input), the weights after each step
and the BatchNorm buffers with the one-device run on the same global batches.

The oracle is the whole batch on one device. The one exception is BatchNorm in train mode, whose
statistics are per replica by definition (nn.DataParallel's semantics): there the oracle applies
the one-device model to each chunk, chunk 0 with the model's own buffers (the running statistics
follow replica 0) and the others with copies.

Tolerances, relative to the largest magnitude of the compared tensor (for gradients: of all the
model's gradients, since a gradient that is zero in exact arithmetic is rounding noise of that size):

* fp32: 1e-5. The replicas compute the same sums as one device over chunks of the batch, added
  in another order; float32 rounds each addition at 2^-24 (6e-8) relative, and the sums here
  have at most a few hundred terms, so they differ by well under 1e-5 of their magnitude.
* float64 (drawn half the time without autocast): 1e-9, the same argument at 2^-53.
* bf16 autocast: 5e-2. bf16 keeps 8 significant bits (2^-8 = 3.9e-3 relative); a different
  accumulation order can round an output to the neighbouring bf16 value, and such one-ulp flips
  pass through the layers and the backward, several ulps in all.

CI runs a fixed-seed profile (``MULTIGPU_FUZZ_EXAMPLES``, default 100, about 30 s on a busy 2-core
machine); ``MULTIGPU_FUZZ_EXAMPLES=2000`` runs a long random one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import multigpu
from multigpu.parallel.chunks import proportional_sizes
from tests.parallel.fuzz_models import CLASSES, VOCAB, FuzzNet, Spec, one_device

EXAMPLES = int(os.environ.get("MULTIGPU_FUZZ_EXAMPLES", "100"))
TOLERANCES = {"float64": 1e-9, "float32": 1e-5, "bf16": 5e-2}


@dataclass(frozen=True)
class Case:
    spec: Spec
    dim: int
    batch: int
    devices: int
    chunk_sizes: Any  # None, ints, float weights or "auto"
    parallel_backward: bool
    set_to_none: bool
    accumulate: int
    autocast: bool
    float64: bool  # model and inputs in float64 (not with autocast): a sharper check, 1e-9
    train: bool  # the module's mode
    grad: bool  # False: no_grad inference, outputs and buffers only
    input_grad: bool  # the float input requires grad (its gradient is compared too)
    loss_on_replicas: bool  # DataParallel(loss_fn=MSELoss()) and model(x, target=y)
    seed: int


@st.composite
def _chunk_sizes(draw: st.DrawFn, batch: int, devices: int) -> Any:
    kind = draw(st.sampled_from(["none", "ints", "weights", "auto"]))
    if kind == "none":
        return None
    if kind == "auto":
        return "auto"
    if kind == "ints":
        cuts = sorted(draw(st.lists(st.integers(0, batch), min_size=devices - 1, max_size=devices - 1)))
        return [b - a for a, b in zip([0, *cuts], [*cuts, batch])]
    weights = draw(st.lists(st.floats(0.0, 3.0), min_size=devices, max_size=devices))
    return weights if sum(weights) > 0.05 else [1.0] * devices


@st.composite
def cases(draw: st.DrawFn) -> Case:
    trunk = draw(st.sampled_from(["linear", "conv1d", "conv2d", "embedding", "gru", "lstm"]))
    grad = draw(st.booleans())
    train = draw(st.booleans())
    output = draw(st.sampled_from(["tensor", "dict", "tuple", "dataclass", "nested"]))
    norms = ["none", "layer", "batch"] if trunk.startswith("conv") else ["none", "layer"]
    spec = Spec(
        trunk=trunk,
        groups=draw(st.sampled_from([1, 2, 4])),
        norm=draw(st.sampled_from(norms)),
        dropout=not train and draw(st.booleans()),
        tied=draw(st.booleans()),
        shared=draw(st.booleans()),
        grad_buffer=draw(st.booleans()),
        param_containers=draw(st.booleans()),
        unused=draw(st.booleans()),
        output=output,
        scalar=draw(st.booleans()),
        kwargs=draw(st.booleans()),
        # BatchNorm in train mode depends on the split, which a nested DataParallel splits again
        nested=0 if (train and norms[-1] == "batch") else draw(st.sampled_from([0, 0, 2, 3])),
        frozen=draw(st.booleans()),
    )
    dim = draw(st.sampled_from([0, 1, -1]))
    batch, devices = draw(st.integers(1, 9)), draw(st.integers(1, 4))
    return Case(
        spec=spec,
        dim=dim,
        batch=batch,
        devices=devices,
        chunk_sizes=draw(_chunk_sizes(batch, devices)),
        parallel_backward=draw(st.booleans()),
        set_to_none=draw(st.booleans()),
        accumulate=draw(st.integers(1, 3)),
        # torch's CPU LSTM/GRU under bf16 autocast fails in oneDNN on this machine, with or without us
        autocast=(autocast := trunk not in ("gru", "lstm") and draw(st.booleans())),
        float64=not autocast and draw(st.booleans()),
        train=train,
        grad=grad,
        input_grad=grad and not spec.long_inputs and draw(st.booleans()),
        loss_on_replicas=grad and output == "tensor" and not spec.scalar and dim == 0 and draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 200,  # the CI profile is the same examples every run
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=cases())
def test_data_parallel_matches_one_device(case: Case) -> None:
    run_case(case)


def run_case(case: Case) -> None:
    """Train ``case`` with DataParallel and on one device; fail on the first difference."""
    torch.manual_seed(case.seed)
    net = FuzzNet(case.spec, case.dim, _dtype(case)).train(case.train)
    ref = one_device(net)
    model = multigpu.DataParallel(
        net,
        devices=f"cpu:{case.devices}",
        dim=case.dim,
        chunk_sizes=case.chunk_sizes,
        parallel_backward=case.parallel_backward,
        loss_fn=nn.MSELoss() if case.loss_on_replicas else None,
    )
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (net, ref)]
    tol = TOLERANCES["bf16" if case.autocast else "float64" if case.float64 else "float32"]
    try:
        for step in range(2 if case.grad else 1):
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=case.set_to_none)
            for micro in range(case.accumulate if case.grad else 1):
                _micro_step(case, model, net, ref, tol, f"step {step} micro {micro}")
            if case.grad:
                _compare_grads(net, ref, tol, f"step {step}")
                for optimizer in optimizers:
                    optimizer.step()
                _compare_named(net.named_parameters(), ref.named_parameters(), tol, f"weights after step {step}")
        _compare_named(net.named_buffers(), ref.named_buffers(), tol, "buffers")
    finally:
        model.close()


def _micro_step(case: Case, model: nn.Module, net: FuzzNet, ref: FuzzNet, tol: float, where: str) -> None:
    x, kwargs = _batch(case)
    x_ref = x.detach().clone().requires_grad_(x.requires_grad)
    kwargs_ref = {
        k: v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
        for k, v in kwargs.items()
    }
    target = torch.zeros(case.batch, CLASSES, dtype=_dtype(case)) if case.loss_on_replicas else None
    with _context(case):
        out = model(x, **kwargs) if target is None else model(x, target=target, **kwargs)
        want = _oracle(case, model, ref, x_ref, kwargs_ref)
        if target is not None:
            want = nn.functional.mse_loss(want, target)
    _compare_tree(out, want, tol, f"{where}: outputs")
    if not case.grad:
        return
    loss, want_loss = (out, want) if target is not None else (_user_loss(out), _user_loss(want))
    _close(loss, want_loss, tol, f"{where}: loss")
    (loss / case.accumulate).backward()
    (want_loss / case.accumulate).backward()
    if case.input_grad:
        _close(x.grad, x_ref.grad, tol, f"{where}: input gradient")
        if case.spec.kwargs:
            # a sum over the whole batch that may cancel: measured against the parameters' gradients
            largest = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
            _close(
                kwargs["scale"].grad, kwargs_ref["scale"].grad, tol, f"{where}: gradient of the shared scale", largest
            )


def _batch(case: Case) -> tuple[torch.Tensor, dict[str, Any]]:
    shape = case.spec.input_shape(case.batch)
    x = torch.randint(0, VOCAB, shape) if case.spec.long_inputs else torch.randn(shape, dtype=_dtype(case))
    x = x.movedim(0, case.dim).contiguous().requires_grad_(case.input_grad)
    kwargs: dict[str, Any] = {}
    if case.spec.kwargs:
        mask = (torch.rand(case.batch, 1) > 0.3).to(_dtype(case)).movedim(0, case.dim)
        # a shared 0-dim tensor that requires grad: every replica's share must reach it
        scale = torch.tensor(1.5, dtype=_dtype(case), requires_grad=case.input_grad)
        kwargs = {"mask": mask, "scale": scale, "flag": "on"}
    return x, kwargs


def _dtype(case: Case) -> torch.dtype:
    return torch.float64 if case.float64 else torch.float32


def _context(case: Case) -> Any:
    stack = contextlib.ExitStack()
    if not case.grad:
        stack.enter_context(torch.no_grad())
    if case.autocast:
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
    return stack


def _oracle(case: Case, model: Any, ref: FuzzNet, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    """One device: the whole batch; with BatchNorm in train mode, each chunk as the replicas saw it."""
    if not (case.train and case.spec.norm == "batch"):
        return ref(x, **kwargs)
    sizes = [s for s in _chunks_used(case, model) if s > 0]
    params = dict(ref.named_parameters())
    outs = []
    for i, (xi, ki) in enumerate(_split((x, kwargs), sizes, case.dim)):
        if i == 0:  # replica 0 updates the model's own running statistics
            outs.append(ref(xi, **ki))
        else:
            buffers = {n: b.clone() for n, b in ref.named_buffers()}
            outs.append(functional_call(ref, {**params, **buffers}, (xi,), ki))
    return _cat(outs, sizes, case.dim)


def _chunks_used(case: Case, model: Any) -> list[int]:
    n, batch, spec = case.devices, case.batch, case.chunk_sizes
    if spec == "auto" and batch in model.balance_plans:
        return list(model.balance_plans[batch].sizes)
    if spec is None or spec == "auto" or n == 1:
        return [batch // n + (1 if i < batch % n else 0) for i in range(n)] if n > 1 else [batch]
    if all(isinstance(v, int) for v in spec):
        return list(spec)
    return proportional_sizes(batch, spec)


def _split(obj: Any, sizes: list[int], dim: int) -> list[Any]:
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            return [obj] * len(sizes)
        return list(obj.split(sizes, dim))
    if isinstance(obj, dict):
        parts = {k: _split(v, sizes, dim) for k, v in obj.items()}
        return [{k: parts[k][i] for k in obj} for i in range(len(sizes))]
    if isinstance(obj, tuple):
        columns = [_split(v, sizes, dim) for v in obj]
        return [tuple(c[i] for c in columns) for i in range(len(sizes))]
    return [obj] * len(sizes)


def _cat(outs: list[Any], sizes: list[int], dim: int) -> Any:
    first = outs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return sum(o * (s / sum(sizes)) for o, s in zip(outs, sizes))
        return torch.cat(outs, dim)
    if isinstance(first, dict):
        return {k: _cat([o[k] for o in outs], sizes, dim) for k in first}
    if isinstance(first, tuple):
        return tuple(_cat([o[i] for o in outs], sizes, dim) for i in range(len(first)))
    if dataclasses.is_dataclass(first):
        fields = [f.name for f in dataclasses.fields(first)]
        return type(first)(**{f: _cat([getattr(o, f) for o in outs], sizes, dim) for f in fields})
    return first


def _leaves(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(v)]
    if isinstance(obj, (tuple, list)):
        return [x for v in obj for x in _leaves(v)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [x for f in dataclasses.fields(obj) for x in _leaves(getattr(obj, f.name))]
    return [obj]


def _user_loss(out: Any) -> torch.Tensor:
    """The user's criterion on the gathered outputs: mean squares of every output tensor."""
    tensors = [t for t in _leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return torch.stack([_widened(t).pow(2).mean() for t in tensors]).sum()


def _widened(t: torch.Tensor) -> torch.Tensor:
    """bf16 as float32, float64 kept."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _compare_tree(got: Any, want: Any, tol: float, where: str) -> None:
    assert type(got) is type(want), f"{where}: {type(got).__name__} vs {type(want).__name__}"
    got_leaves, want_leaves = _leaves(got), _leaves(want)
    assert len(got_leaves) == len(want_leaves), where
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        if isinstance(w, torch.Tensor):
            _close(g, w, tol, f"{where}[{i}]")
        else:
            assert g == w, f"{where}[{i}]: {g!r} vs {w!r}"


def _compare_grads(net: FuzzNet, ref: FuzzNet, tol: float, where: str) -> None:
    # in the same order on both sides (a nested DataParallel adds ".module" to the names)
    named = [*net.named_parameters(), *((n, b) for n, b in net.named_buffers() if b.requires_grad)]
    ref_tensors = [*ref.parameters(), *(b for b in ref.buffers() if b.requires_grad)]
    assert len(named) == len(ref_tensors), where
    # A gradient that is zero in exact arithmetic (a conv bias before BatchNorm) is rounding noise
    # on both sides: its noise scales with the model's gradients, so that is its yardstick.
    largest = max((float(t.grad.abs().max()) for t in ref_tensors if t.grad is not None), default=1.0)
    for (name, tensor), ref_tensor in zip(named, ref_tensors):
        want = ref_tensor.grad
        if want is None:
            assert tensor.grad is None or not tensor.grad.any(), f"{where}: {name} has a gradient, one device none"
        else:
            _close(tensor.grad, want, tol, f"{where}: gradient of {name}", floor=largest)


def _compare_named(got: Any, want: Any, tol: float, where: str) -> None:
    for (name, g), (_, w) in zip(got, want):
        _close(g, w, tol, f"{where}: {name}")


def _close(got: Any, want: Any, tol: float, where: str, floor: float = 0.0) -> None:
    assert isinstance(got, torch.Tensor), f"{where}: got {type(got).__name__}, want a tensor"
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{where}: {got.shape}/{got.dtype} vs {want.shape}/{want.dtype}"
    )
    if not want.is_floating_point():
        assert torch.equal(got, want), where
        return
    scale = max(float(want.detach().abs().max()) if want.numel() else 0.0, floor) or 1.0
    torch.testing.assert_close(
        got.detach().double(), want.detach().double(), rtol=tol, atol=tol * scale, msg=lambda m: f"{where}: {m}"
    )
