"""DDP's knobs, comm hooks, sync BatchNorm and compile in two real gloo processes, against one device.

One launch runs every scenario (tests/strategies/ddp_options_worker.py); each test checks one of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from multigpu.checkpoint.formats import read_tensors
from tests.launching import launch_workers
from tests.session.oracle import regression_data
from tests.strategies.strategy_oracle import (
    Branchy,
    adamw,
    assert_weights_close,
    batchnorm_model,
    deep_model,
    max_difference,
    one_device_train,
    sgd,
)

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("ddp_options_worker.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("ddp-options")
    launch_workers(WORKER, str(out), timeout_s=240)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="module")
def ranks(run: tuple[Path, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return run[1]


def test_an_unused_branch_fails_in_the_next_forward_naming_the_option(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        failure = rank["unused_fails"]
        assert failure["step"] == 1  # the first backward leaves the branch unreduced; the second forward fails
        assert "pass Session(ddp=DDPOptions(find_unused_parameters=True))" in failure["message"]
        assert "Expected to have finished reduction in the prior iteration" in failure["message"]
        assert failure["cause"] == "RuntimeError"  # torch's error stays chained


def test_find_unused_parameters_trains_the_branchy_model_like_one_device(ranks: list[dict[str, Any]]) -> None:
    torch.manual_seed(0)
    untouched = Branchy().unused.state_dict()
    want = one_device_train(regression_data(32), Branchy, sgd).state_dict()
    for rank in ranks:
        got = rank["unused_found"]["state_dict"]
        assert_weights_close(got, want, atol=1e-6)
        torch.testing.assert_close(got["unused.weight"], untouched["weight"], rtol=0, atol=0)


def test_the_other_knobs_keep_the_one_device_weights(ranks: list[dict[str, Any]]) -> None:
    # static_graph, gradient copies instead of bucket views, tiny buckets, no buffer broadcast
    want = one_device_train(regression_data(32), deep_model, sgd).state_dict()
    for rank in ranks:
        assert_weights_close(rank["knobs"]["state_dict"], want, atol=1e-6)


# Distance from the exact all-reduce's weights after 8 SGD steps (lr 0.2), measured then bounded:
# fp16 rounds each averaged gradient to 11 significant bits (measured 1.4e-4), bf16 to 8 bits
# (measured 8e-4); PowerSGD rank 1 from step 2 sends a rank-1 approximation of each weight
# gradient, its error fed back into the next step (measured 3.3e-2).
HOOK_TOLERANCE = {"fp16": 1e-3, "bf16": 5e-3, "powersgd": 0.1}


@pytest.mark.parametrize("hook", sorted(HOOK_TOLERANCE))
def test_each_comm_hook_trains_near_the_exact_weights(ranks: list[dict[str, Any]], hook: str) -> None:
    want = one_device_train(regression_data(32), deep_model, sgd).state_dict()
    result = ranks[0][hook]
    assert_weights_close(result["state_dict"], want, atol=HOOK_TOLERANCE[hook], rtol=0)
    assert max_difference(result["state_dict"], want) > 1e-6  # the hook compressed: not the exact all-reduce
    assert result["losses"][-1] < 0.1 * result["losses"][0]
    assert_weights_close(ranks[1][hook]["state_dict"], result["state_dict"], atol=0, rtol=0)  # the ranks agree


def test_sync_batchnorm_equals_one_device_batchnorm_on_the_global_batch(ranks: list[dict[str, Any]]) -> None:
    # The first training step: outputs of the whole global batch (gathered from the ranks in rank
    # order) and the gradients DDP averaged, against one BatchNorm over that same global batch.
    first = ranks[0]["sync_batchnorm"]["first"]
    torch.manual_seed(0)
    model = batchnorm_model()
    out = model(first["inputs"])
    torch.testing.assert_close(first["outputs"], out.detach(), rtol=1e-5, atol=1e-6)
    F.mse_loss(out, first["targets"]).backward()
    for rank in ranks:
        for name, param in model.named_parameters():
            torch.testing.assert_close(rank["sync_batchnorm"]["first"]["grads"][name], param.grad, msg=name)


def test_sync_batchnorm_trains_and_evaluates_like_one_device(ranks: list[dict[str, Any]]) -> None:
    model = one_device_train(regression_data(32), batchnorm_model, sgd)
    model.eval()
    with torch.no_grad():
        want_eval = model(regression_data(11).tensors[0])
    for rank in ranks:
        trained = rank["sync_batchnorm"]["trained"]
        assert_weights_close(trained["state_dict"], model.state_dict(), atol=1e-6)  # weights and running statistics
        torch.testing.assert_close(trained["eval_outputs"], want_eval, rtol=1e-5, atol=1e-6)
    # Plain BatchNorm normalizes each rank's half batch on its own: far from one device. The check bites.
    assert max_difference(ranks[0]["plain_batchnorm"]["state_dict"], model.state_dict()) > 1e-2


def test_compile_trains_to_the_eager_weights_and_saves_bare_keys(run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, ranks = run
    want = one_device_train(regression_data(32), deep_model, adamw, accumulate=2).state_dict()
    for rank in ranks:
        result = rank["compile"]
        assert_weights_close(result["state_dict"], want, atol=1e-5)  # inductor may fuse and reorder float32 operations
        assert result["syncs"] == [False, True] * 4  # no_sync reached the DDP module inside the compiled one
        assert result["keys"][0].startswith("_orig_mod.module.")  # what the compiled module itself reports
    bare = sorted(deep_model().state_dict())
    assert sorted(read_tensors(out / "ddp-compiled.safetensors")[0]) == bare
    assert sorted(read_tensors(out / "ckpt" / "step-00000001" / "model.safetensors")[0]) == bare
