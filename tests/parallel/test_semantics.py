"""One test per nn.DataParallel semantic that multigpu keeps or fixes."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import multigpu
from multigpu.errors import ConfigError, PlacementError, ScatterError
from tests.models import mlp, twin


class Recorder(nn.Module):
    """Records what each replica saw: batch size, kwargs, grad mode, autocast dtype, thread."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seen: list[dict] = []
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor, *, flag: str | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.lin(x)
        with self.lock:
            self.seen.append(
                {
                    "batch": x.size(0),
                    "flag": flag,
                    "mask": None if mask is None else mask.size(0),
                    "grad": torch.is_grad_enabled(),
                    "dtype": y.dtype,
                    "thread": threading.get_ident(),
                }
            )
        return y


def test_kwargs_reach_every_replica_even_when_the_batch_is_smaller_than_the_devices() -> None:
    rec = Recorder()
    out = multigpu.DataParallel(rec, devices="cpu:4")(torch.randn(3, 8), flag="on", mask=torch.ones(3, 2))
    assert out.shape == (3, 8)
    assert sorted(s["batch"] for s in rec.seen) == [1, 1, 1]
    assert all(s["flag"] == "on" and s["mask"] == 1 for s in rec.seen)


def test_uneven_batch_uses_every_device() -> None:
    rec = Recorder()
    multigpu.DataParallel(rec, devices="cpu:4")(torch.randn(5, 8))
    assert sorted(s["batch"] for s in rec.seen) == [1, 1, 1, 2]


def test_no_grad_and_eval_inference() -> None:
    rec = Recorder()
    model = multigpu.DataParallel(rec, devices="cpu:2").eval()
    with torch.no_grad():
        out = model(torch.randn(4, 8))
    assert not out.requires_grad
    assert [s["grad"] for s in rec.seen] == [False, False]
    assert not rec.training and not model.training


def test_autocast_dtype_reaches_the_replicas() -> None:
    rec = Recorder()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = multigpu.DataParallel(rec, devices="cpu:2")(torch.randn(4, 8))
    assert out.dtype == torch.bfloat16
    assert [s["dtype"] for s in rec.seen] == [torch.bfloat16, torch.bfloat16]


def test_forward_and_backward_of_replicas_run_in_their_own_threads() -> None:
    rec = Recorder()
    backward_threads: set[int] = set()
    rec.lin.register_full_backward_hook(lambda *_: backward_threads.add(threading.get_ident()))
    out = multigpu.DataParallel(rec, devices="cpu:2")(torch.randn(4, 8))
    out.sum().backward()
    assert len({s["thread"] for s in rec.seen}) == 2
    assert len(backward_threads) == 2


def test_batchnorm_running_stats_follow_replica_zero() -> None:
    net, ref = twin(lambda: nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4)))
    x = torch.randn(10, 8)
    multigpu.DataParallel(net, devices="cpu:2")(x)
    ref(x[:5])  # replica 0's chunk
    torch.testing.assert_close(net[1].running_mean, ref[1].running_mean)
    torch.testing.assert_close(net[1].running_var, ref[1].running_var)
    assert int(net[1].num_batches_tracked) == 1


class Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x[0, 0] > 100:
            raise ValueError("bad sample")
        return x


def test_replica_exception_names_the_replica_and_device() -> None:
    x = torch.zeros(4, 2)
    x[2, 0] = 1000  # lands in replica 1's chunk
    with pytest.raises(
        ValueError, match=r"Caught ValueError in replica 1 on device cpu:1 during forward(.|\n)*bad sample"
    ):
        multigpu.DataParallel(Fails(), devices="cpu:2")(x)


def test_one_device_calls_the_module_directly() -> None:
    class Identity(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    x = torch.randn(3, 2)
    assert multigpu.DataParallel(Identity(), devices="cpu")(x) is x


def test_empty_batch_is_a_clear_error() -> None:
    with pytest.raises(ScatterError, match=r"empty batch \(size 0 along dim 0\).*drop_last"):
        multigpu.DataParallel(mlp(), devices="cpu:2")(torch.randn(0, 8))


def test_disagreeing_batch_sizes_are_named() -> None:
    class Two(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a

    with pytest.raises(
        ScatterError,
        match=r"input\[0\]\[0\] has 4, input\[0\]\[1\] has 3 \(shape \(3, 2\)\); pass tensors of one batch",
    ):
        multigpu.DataParallel(Two(), devices="cpu:2")(torch.randn(4, 2), torch.randn(3, 2))
    # position_ids of shape (1, T), as a transformer broadcasts them: the advice was a tensor with "fewer dims than
    # dim", which at dim=0 only a 0-dim tensor has
    with pytest.raises(
        ScatterError, match=r"has 1 \(shape \(1, 6\)\); expand the one of size 1 to the batch \(x\.expand\(4, "
    ):
        multigpu.DataParallel(Two(), devices="cpu:2")(torch.randn(4, 6), torch.arange(6).unsqueeze(0))


def test_module_off_the_primary_device_is_named() -> None:
    net = mlp().to(torch.float64)
    model = multigpu.DataParallel(net, devices="cpu:2")
    model.module.extra = nn.Linear(1, 1, device="meta")
    with pytest.raises(PlacementError, match=r"'extra.weight' is on meta.*model.to\('cpu'\)"):
        model(torch.randn(4, 8, dtype=torch.float64))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scalar_outputs": "max"}, r"scalar_outputs='max' is not one of"),
        ({"dim": 1.5}, r"dim=1.5 must be an int"),
        ({"chunk_sizes": [1, 2, 3]}, r"chunk_sizes=\[1, 2, 3\] has 3 entries for 2 devices"),
        ({"chunk_sizes": "fast"}, r"chunk_sizes='fast' is not a list"),
        ({"chunk_sizes": [-1.0, 2.0]}, r"must be non-negative"),
    ],
)
def test_bad_options_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        multigpu.DataParallel(mlp(), devices="cpu:2", **kwargs)


def test_device_ids_and_devices_together_are_refused() -> None:
    with pytest.raises(ConfigError, match="pass device_ids or devices, not both"):
        multigpu.DataParallel(mlp(), device_ids=[0], devices="cpu:2")


def test_state_dict_loads_into_the_bare_model_and_accepts_prefixes() -> None:
    net, bare = twin(mlp)
    model = multigpu.DataParallel(net, devices="cpu:2")
    assert list(model.state_dict()) == list(bare.state_dict())
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    bare.load_state_dict(model.state_dict())
    fresh = multigpu.DataParallel(mlp(), devices="cpu:2")
    for prefix in ("", "module.", "_orig_mod.", "module._orig_mod."):
        fresh.load_state_dict({prefix + k: v for k, v in bare.state_dict().items()})
        for p, q in zip(fresh.module.parameters(), net.parameters()):
            torch.testing.assert_close(p, q)


def test_state_dict_of_a_model_holding_the_wrapper() -> None:
    outer = nn.Sequential()
    outer.add_module("body", multigpu.DataParallel(mlp(), devices="cpu:2"))
    assert all(k.startswith("body.") and ".module." not in k for k in outer.state_dict())
    outer.load_state_dict(outer.state_dict())


def test_unwrap_every_wrapper() -> None:
    net = mlp()
    assert multigpu.unwrap(multigpu.DataParallel(net, devices="cpu:2")) is net
    assert multigpu.unwrap(nn.DataParallel(net)) is net
    assert multigpu.unwrap(torch.compile(net)) is net
    assert multigpu.unwrap(net) is net
    sd = multigpu.clean_state_dict({"module._orig_mod.0.weight": 1})
    assert list(sd) == ["0.weight"]


def test_outputs_gather_on_the_output_device_and_repr_lists_devices() -> None:
    model = multigpu.DataParallel(mlp(), devices="cpu:2", output_device="cpu")
    assert model(torch.randn(4, 8)).device == torch.device("cpu")
    assert "devices=[cpu:0, cpu:1]" in repr(model)


@pytest.mark.cuda
def test_cuda_replicas_match_one_device() -> None:
    n = torch.cuda.device_count()
    net, ref = twin(mlp)
    model = multigpu.DataParallel(net.cuda(), device_ids=list(range(n)))
    ref.cuda()
    x = torch.randn(8 * n, 8, device="cuda")
    model(x).sum().backward()
    ref(x).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


class OwnsAModuleChild(nn.Module):
    """A model whose own child is called ``module`` and which has its own ``weight`` too."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 2)
        self.weight = nn.Parameter(torch.randn(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x) * self.weight


def test_a_child_named_module_saves_and_loads_every_tensor() -> None:
    net, bare = twin(OwnsAModuleChild)
    model = multigpu.DataParallel(net, devices="cpu:2")
    saved = model.state_dict()
    assert sorted(saved) == sorted(bare.state_dict()) == ["module.bias", "module.weight", "weight"]
    fresh = multigpu.DataParallel(OwnsAModuleChild(), devices="cpu:2")
    fresh.load_state_dict(saved)  # bare keys, one of them starting with "module."
    fresh.load_state_dict(nn.DataParallel(bare).state_dict())  # nn.DataParallel's: "module.module.weight"
    for p, q in zip(fresh.module.parameters(), net.parameters()):
        torch.testing.assert_close(p, q)


def test_keys_that_name_one_tensor_twice_are_refused() -> None:
    model = multigpu.DataParallel(mlp(), devices="cpu:2")
    state = {k: v for k, v in model.state_dict().items()}
    state["module.0.weight"] = state["0.weight"]
    with pytest.raises(multigpu.CheckpointError, match=r"0.weight, module.0.weight -> 0.weight"):
        model.load_state_dict(state)
