"""Input copies are ordered before the work that reads them, and their host memory outlives them.

How the engine does it (multigpu.core.comm, multigpu.parallel.threads): split_to_devices copies each chunk with
``Tensor.to(device, non_blocking=True)`` on the caller's current stream of that device (it has no side
streams of its own, unlike torch's ``Scatter``), and each replica computes on that same stream: replica 0
on the calling thread, the others on worker threads that enter the caller's stream of their device, as
torch's ``parallel_apply`` does. Stream order then puts every read after its copy. A pinned source stays
reserved by torch's caching host allocator until the copy has run (it records an event for every
non_blocking copy from pinned memory), so the caller may drop the batch as soon as the call returns.

These tests check the properties, not the mechanism: many steps of large pinned batches, each consumed
at once, against the synchronous oracle (the bare module on a batch copied with ``.cuda()``, which
blocks), on the default stream and on the caller's own streams; and a batch freed, its memory asked for
again and filled with garbage, while its copy still waits behind a busy stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import multigpu
from tests.cuda.conftest import tolerance
from tests.models import twin

pytestmark = pytest.mark.cuda
FEATURES, CLASSES, BATCH = 1024, 10, 4096  # a 16 MiB input batch: its copy is long enough to race with
STEPS = 12
SHORT_BUSY = 20_000_000  # torch.cuda._sleep cycles (~10 ms): copies queued behind it run late
LONG_BUSY = 500_000_000  # ~0.25 s: far longer than the host needs to issue one step
SPLIT_TOL = {"rtol": 1e-4, "atol": 1e-6}  # float32, batch split across GPUs, a few SGD steps


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, CLASSES))


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, FEATURES, generator=gen), torch.randint(0, CLASSES, (BATCH,), generator=gen))
        for _ in range(count)
    ]


@contextlib.contextmanager
def _on_streams(streams: dict[int, torch.cuda.Stream]) -> Iterator[None]:
    """Make ``streams[i]`` the current stream of device i inside the block (for this thread)."""
    with contextlib.ExitStack() as stack:
        for stream in streams.values():
            stack.enter_context(torch.cuda.stream(stream))
        yield


@pytest.mark.parametrize("streams", ["default", "own"])
def test_pinned_batches_copied_without_blocking_train_like_the_synchronous_oracle(
    gpu_ids: list[int], streams: str
) -> None:
    net, ref = twin(_net)
    model = multigpu.DataParallel(net.cuda(), device_ids=gpu_ids, loss_fn=nn.CrossEntropyLoss())
    ref.cuda()
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (net, ref))
    chosen = {i: torch.cuda.Stream(i) if streams == "own" else torch.cuda.current_stream(i) for i in gpu_ids}
    seen: list[tuple[int, torch.cuda.Stream]] = []  # (device, stream) of each replica's forward
    net.register_forward_pre_hook(lambda _m, args: seen.append((args[0].device.index, torch.cuda.current_stream())))
    losses, wanted = [], []
    for step, (x, y) in enumerate(_batches(STEPS)):
        pinned_x, pinned_y = x.pin_memory(), y.pin_memory()
        with _on_streams(chosen):
            if step % 2:  # the copies queue behind other work on their stream: a reader that did not wait reads early
                for i in gpu_ids:
                    with torch.cuda.device(i):
                        torch.cuda._sleep(SHORT_BUSY)
            loss = model(pinned_x, target=pinned_y)  # consumed at once: the first layer reads the chunk
            del pinned_x, pinned_y
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        want = nn.functional.cross_entropy(ref(x.cuda()), y.cuda())  # .cuda() from pageable memory: blocks
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        wanted.append(want.detach())
    torch.cuda.synchronize()
    tol = tolerance(gpu_ids, **SPLIT_TOL)
    torch.testing.assert_close(torch.stack(losses), torch.stack(wanted), **tol)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **tol)
    assert {(i, s) for i, s in seen} == {(i, chosen[i]) for i in gpu_ids}  # each replica on its device's stream
    assert len(seen) == STEPS * len(gpu_ids)


def test_a_batch_freed_while_its_copy_waits_is_not_overwritten() -> None:
    """One GPU, loss on the replica: the step issues its copies and kernels without waiting for the device."""
    net, ref = twin(_net)
    model = multigpu.DataParallel(net.cuda(), device_ids=[0], loss_fn=nn.CrossEntropyLoss())
    ref.cuda()
    ((x, y),) = _batches(1)
    model(x.pin_memory(), target=y.pin_memory())  # warm-up: cuBLAS handle and cached blocks (first use may sync)
    want = nn.functional.cross_entropy(ref(x.cuda()), y.cuda())
    torch.cuda.synchronize()
    pinned_x, pinned_y = x.pin_memory(), y.pin_memory()
    torch.cuda._sleep(LONG_BUSY)  # the stream is busy: the step's copies queue behind it
    loss = model(pinned_x, target=pinned_y)
    in_flight = not torch.cuda.current_stream().query()
    del pinned_x, pinned_y  # the only references: the engine keeps none of the host batch
    # Pinned memory asked for again at once; were the batch's blocks handed out, the garbage would be copied.
    garbage = [torch.full_like(x, float("nan")).pin_memory(), torch.full_like(y, -1).pin_memory()]
    torch.cuda.synchronize()
    assert in_flight, "the step waited for the device (a sync point): the copy was no longer in flight"
    assert torch.equal(loss, want), (loss.item(), want.item())
    assert garbage[0].isnan().all()  # the garbage was really written
