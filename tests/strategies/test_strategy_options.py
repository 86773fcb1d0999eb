"""DDPOptions, FSDPOptions, the fsdp wrap rule, sync BatchNorm's arithmetic and the one-process no-ops.

In one process; the multi-process behaviour is in test_fsdp.py and test_ddp_options.py.
"""

from __future__ import annotations

import platform
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from multigpu.devices import get_device_type
from multigpu.errors import ConfigError, LaunchError
from multigpu.parallel import DataParallel
from multigpu.session import DDPOptions, FSDPOptions, Session, SessionConfig
from multigpu.strategies.fsdp import select_blocks, warn_if_started_without_sharding_env
from multigpu.strategies.sync_batchnorm import CPUSyncBatchNorm, _SyncBatchNorm, apply_sync_batchnorm
from tests.strategies.strategy_oracle import Block, deep_model

# -- option validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"comm_hook": "int8"}, r"comm_hook='int8'\) is not one of \[None, 'fp16', 'bf16', 'powersgd'\]"),
        ({"bucket_cap_mb": 0}, r"bucket_cap_mb=0\) must be > 0 MiB"),
        ({"powersgd_rank": 0}, r"powersgd_rank=0\) must be >= 1"),
        ({"powersgd_start_iter": 1}, r"powersgd_start_iter=1\) must be >= 2"),
        ({"static_graph": "yes"}, r"static_graph='yes'\) must be True or False"),
    ],
)
def test_ddp_options_are_validated(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DDPOptions(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"wrap": [int]}, r"must list nn.Module classes, e.g. wrap=\[Block\]"),
        ({"wrap": []}, r"must list nn.Module classes"),
        ({"wrap": [nn.Linear(2, 2)]}, r"must list nn.Module classes"),
        ({"max_share": 0}, r"max_share=0\) must lie in \(0, 1\]"),
        ({"max_share": 1.5}, r"max_share=1.5\) must lie in \(0, 1\]"),
        ({"min_share": 0.2}, r"min_share=0.2\) must lie in \[0, max_share=0.1\]"),
    ],
)
def test_fsdp_options_are_validated(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        FSDPOptions(**kwargs)  # type: ignore[arg-type]


def test_options_are_keyword_only_and_reach_the_session_config() -> None:
    with pytest.raises(TypeError):
        DDPOptions(True)  # type: ignore[misc]
    assert FSDPOptions(wrap=[Block]).wrap == (Block,)  # kept as a tuple: the list cannot change later
    config = SessionConfig(ddp=DDPOptions(comm_hook="bf16"), sync_batchnorm=True, compile=True)
    assert config.ddp.comm_hook == "bf16" and config.fsdp == FSDPOptions()
    with pytest.raises(ConfigError, match=r"ddp=\{'comm_hook': 'fp16'\} must be a DDPOptions; use e.g. ddp=DDPOptions"):
        SessionConfig(ddp={"comm_hook": "fp16"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"fsdp=None must be a FSDPOptions"):
        SessionConfig(fsdp=None)  # type: ignore[arg-type]


def test_fsdp_outside_a_launch_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MULTIGPU_STRATEGY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LaunchError, match=r"strategy 'fsdp' needs a launched process.*multigpu launch"):
        Session(strategy="fsdp").start()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc tunables")
def test_fsdp_on_the_cpu_without_the_launchers_malloc_setting_says_how_to_get_it() -> None:
    with pytest.warns(
        RuntimeWarning, match=r"started without GLIBC_TUNABLES=glibc\.malloc.*multigpu launch --strategy fsdp"
    ):
        warn_if_started_without_sharding_env(torch.device("cpu"), {"PATH": "/bin"})
    launched = get_device_type("cpu").sharded_process_env({})  # what multigpu launch gives the workers
    for environ in (launched, {"MALLOC_ARENA_MAX": "2"}):  # set by the launcher, or malloc set by the user
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warn_if_started_without_sharding_env(torch.device("cpu"), environ)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_started_without_sharding_env(torch.device("cuda", 0), {})  # a caching allocator: nothing to set


# -- which modules fsdp shards on their own -----------------------------------------------------


def _names(model: nn.Module, blocks: list[nn.Module]) -> list[str]:
    names = {id(m): name for name, m in model.named_modules()}
    return [names[id(b)] for b in blocks]


def test_the_default_rule_splits_modules_above_max_share_and_leaves_tiny_ones_to_the_root() -> None:
    model = deep_model()  # shares of 362 parameters: 0: 15%, blocks 40% each (inner/outer 20%), 3: 5%
    assert _names(model, select_blocks(model, FSDPOptions())) == ["0", "1.inner", "1.outer", "2.inner", "2.outer", "3"]
    assert _names(model, select_blocks(model, FSDPOptions(max_share=0.5))) == ["0", "1", "2", "3"]
    assert _names(model, select_blocks(model, FSDPOptions(max_share=0.5, min_share=0.1))) == ["0", "1", "2"]


def test_containers_are_always_split_and_shared_parameters_stay_with_the_root() -> None:
    embed, head = nn.Embedding(50, 8), nn.Linear(8, 50, bias=False)
    head.weight = embed.weight  # tied: two modules, one parameter
    layers = nn.ModuleList([Block(8) for _ in range(2)])
    model = nn.ModuleDict({"embed": embed, "layers": layers, "head": head})
    # 688 parameters: the tied weight 58%, each block 21%. The ModuleList has no forward, so it is
    # split even below max_share; the embedding and the head share a weight: both stay with the root.
    assert _names(model, select_blocks(model, FSDPOptions(max_share=0.5))) == ["layers.0", "layers.1"]


def test_named_classes_are_sharded_children_first() -> None:
    outer = Block(4)
    outer.inner = Block(4)  # type: ignore[assignment]  # a Block nested in a Block
    model = nn.Sequential(outer, Block(4))
    assert _names(model, select_blocks(model, FSDPOptions(wrap=[Block]))) == ["1", "0.inner", "0"]


# -- synchronized BatchNorm ---------------------------------------------------------------------


# The group is the same for every example (nothing in it changes between them).
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=st.sampled_from([(5, 3), (4, 3, 7), (2, 3, 4, 5), (3, 3, 2, 2, 2)]),
    momentum=st.sampled_from([0.1, 0.5]),
    affine=st.booleans(),
    offset=st.sampled_from([0.0, 1e3]),  # a large mean: E[x^2] - E[x]^2 would cancel there
)
def test_the_sync_function_computes_batchnorm(
    one_rank_group: None, shape: tuple[int, ...], momentum: float, affine: bool, offset: float
) -> None:
    # With one rank the collectives are identities: outputs, gradients and running statistics
    # must be BatchNorm's own (the two-rank runs check the combination across ranks). The oracle
    # runs in float64; at a mean of 1e3 float32 itself resolves only ~6e-5 (measured: 2e-4 off),
    # hence the scaled bound; the one-pass E[x^2] - E[x]^2 would miss the variance by ~0.4 there.
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) + offset).float()
    grad_out = torch.randn(shape, generator=gen)
    weight = torch.rand(shape[1], generator=gen) + 0.5 if affine else None
    bias = torch.randn(shape[1], generator=gen) if affine else None
    inputs = [t.clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    oracle = [t.double().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    stats = [torch.zeros(shape[1]), torch.ones(shape[1])]
    want_stats = [s.double() for s in stats]
    got = _SyncBatchNorm.apply(inputs[0], inputs[1], inputs[2], *stats, 1e-5, momentum)
    want = F.batch_norm(oracle[0], *want_stats, oracle[1], oracle[2], True, momentum, 1e-5)
    got.backward(grad_out)
    want.backward(grad_out.double())
    tol = 1e-5 + 5e-7 * offset
    torch.testing.assert_close(got, want.float(), rtol=0, atol=tol)
    for mine, theirs in zip(inputs, oracle):
        if mine is not None:
            torch.testing.assert_close(mine.grad, theirs.grad.float(), rtol=1e-4, atol=tol * 2)
    for mine, theirs in zip(stats, want_stats):
        torch.testing.assert_close(mine, theirs.float(), rtol=1e-5, atol=tol)


def test_conversion_keeps_parameters_buffers_and_keys() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=None), nn.Sequential(nn.BatchNorm2d(4)))
    keys, params = list(model.state_dict()), list(model.parameters())
    converted = apply_sync_batchnorm(model, torch.device("cpu"))
    assert [type(m).__name__ for m in converted.modules()].count("CPUSyncBatchNorm") == 2
    assert list(converted.state_dict()) == keys
    assert all(a is b for a, b in zip(converted.parameters(), params))  # an optimizer built before still works


@pytest.mark.parametrize("momentum", [0.1, None])
def test_without_a_group_it_is_batchnorm_in_train_and_eval(momentum: float | None) -> None:
    plain = nn.BatchNorm1d(3, momentum=momentum)
    synced = apply_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(3, momentum=momentum)), torch.device("cpu"))[0]
    assert isinstance(synced, CPUSyncBatchNorm)
    for _ in range(3):
        x = torch.randn(6, 3) * 2 + 1
        torch.testing.assert_close(synced(x), plain(x))
    torch.testing.assert_close(synced.running_var, plain.running_var)
    synced.eval()
    plain.eval()
    x = torch.randn(4, 3)
    torch.testing.assert_close(synced(x), plain(x))


# -- options that do nothing in one process say so ------------------------------------------------


def test_sync_batchnorm_in_one_process_warns_and_leaves_the_model() -> None:
    with Session(strategy="single", sync_batchnorm=True) as session:
        with pytest.warns(UserWarning, match="sync_batchnorm=True has no effect under strategy 'single'"):
            model = session.setup_model(nn.Sequential(nn.BatchNorm1d(3)))
    assert type(model[0]) is nn.BatchNorm1d


def test_compile_under_dp_warns_and_keeps_the_thread_engine() -> None:
    with Session(strategy="dp", devices="cpu:2", compile=True) as session:
        with pytest.warns(UserWarning, match="compile=True has no effect under strategy 'dp'"):
            model = session.setup_model(nn.Linear(3, 1))
    assert isinstance(model, DataParallel)
