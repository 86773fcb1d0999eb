"""fp16 autocast with ``torch.amp.GradScaler("cuda")`` through DataParallel, against the bare module
under the same autocast and an identical scaler, over a few steps, one of them skipped by the scaler.

Tolerance: bitwise on one GPU (the same kernels on the same shapes); with the batch split across GPUs,
``rtol=1e-2, atol=1e-3`` on losses, unscaled gradients and weights: each replica's float16 partial
results round on their own (float16 has a relative precision of about 1e-3).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import multigpu
from tests.cuda.conftest import tolerance
from tests.models import twin

pytestmark = pytest.mark.cuda
BATCH, FEATURES, CLASSES = 64, 32, 5
STEPS, INF_STEP = 5, 2  # the scaler skips step 2: an inf in the last sample makes every gradient non-finite
SPLIT_TOL = {"rtol": 1e-2, "atol": 1e-3}


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def _scaler() -> torch.amp.GradScaler:
    # A small scale that grows every 2 clean steps: the run sees the scale grow and, at INF_STEP, back off;
    # small enough that no float16 gradient overflows by itself, on the whole batch or on a chunk.
    return torch.amp.GradScaler("cuda", init_scale=2.0**8, growth_interval=2)


@pytest.mark.parametrize("loss_on_replicas", [False, True], ids=["gathered-outputs", "loss-on-replicas"])
def test_fp16_autocast_and_the_grad_scaler_match_the_bare_module(gpu_ids: list[int], loss_on_replicas: bool) -> None:
    net, ref = twin(_net)
    model = multigpu.DataParallel(
        net.cuda(), device_ids=gpu_ids, loss_fn=nn.CrossEntropyLoss() if loss_on_replicas else None
    )
    ref.cuda()
    runs = {"dp": (net, _scaler()), "bare": (ref, _scaler())}
    opts = {name: torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9) for name, (module, _) in runs.items()}
    tol = tolerance(gpu_ids, **SPLIT_TOL)
    gen = torch.Generator().manual_seed(2)
    for step in range(STEPS):
        x = torch.randn(BATCH, FEATURES, generator=gen).cuda()
        y = torch.randint(0, CLASSES, (BATCH,), generator=gen).cuda()
        if step == INF_STEP:
            x[-1, 0] = float("inf")  # the last sample: on the last replica when the batch is split
        seen = {}
        for name, (module, scaler) in runs.items():
            before = [p.detach().clone() for p in module.parameters()]
            with torch.autocast("cuda", dtype=torch.float16):
                if name == "dp" and loss_on_replicas:
                    loss = model(x, target=y)
                    dtypes = {out.dtype for out in model.replica_outputs}
                else:
                    out = model(x) if name == "dp" else module(x)
                    dtypes = {out.dtype}  # a replica left in float32 would make the gathered output float32
                    loss = nn.functional.cross_entropy(out, y)
            assert dtypes == {torch.float16}, f"{name}: autocast did not reach every replica: {dtypes}"
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.unscale_(opts[name])
            grads = [p.grad.detach().clone() for p in module.parameters() if p.grad is not None]
            scaler.step(opts[name])
            scaler.update()
            opts[name].zero_grad()
            moved = any(not torch.equal(p, b) for p, b in zip(module.parameters(), before))
            seen[name] = (loss.detach(), grads, [p.detach().clone() for p in module.parameters()], scale, moved)
        (loss, grads, weights, scale, moved), (want, want_grads, want_weights, want_scale, want_moved) = (
            seen["dp"],
            seen["bare"],
        )
        assert (scale, moved) == (want_scale, want_moved), f"step {step}: scale or skip differ"
        assert moved == (step != INF_STEP), f"step {step}: the scaler skipped (or took) the wrong step"
        if step == INF_STEP:
            assert not loss.isfinite() and not want.isfinite()
            assert all(not g.isfinite().all() for g in grads[:1])  # the first layer's gradient saw the inf
        else:
            torch.testing.assert_close(loss, want, **tol)
            assert len(grads) == len(want_grads)
            for g, h in zip(grads, want_grads):
                torch.testing.assert_close(g, h, **tol)
        for w, v in zip(weights, want_weights):
            torch.testing.assert_close(w, v, **tol)
    assert runs["dp"][1].get_scale() == runs["bare"][1].get_scale() == 2.0**9  # 256 -> 512 -> 256 -> 512
