"""Worker for test_accelerate_semantics.py: Accelerate's semantic checks on real gloo ranks, in one launch.

    multigpu launch --strategy ddp --nproc-per-node 2 tests/session/accelerate_worker.py

Each check agrees its verdict between the ranks before anyone raises (a failing rank would leave
the others waiting in a collective); rank 0 prints ``ok NAME`` per check passed.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from multigpu.errors import ConfigError
from multigpu.session import Session


def agree(ok: bool, what: str, session: Session) -> None:
    """Fail on every rank when ``ok`` is false on any."""
    if session.reduce(0.0 if ok else 1.0, "max") > 0:
        raise AssertionError(f"{what} failed on some rank (this rank: {'ok' if ok else 'FAILED'})")


def uneven_batches(world: int, extra: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Rank r's batches: ``extra + r`` of them, the same tensors on every rank (one generator)."""
    gen = torch.Generator().manual_seed(7)
    return [
        [(torch.randn(3, 4, generator=gen), torch.randn(3, 1, generator=gen)) for _ in range(extra + r)]
        for r in range(world)
    ]


def join_oracle(batches: list[list[tuple[torch.Tensor, torch.Tensor]]], start: nn.Module) -> nn.Module:
    """Plain torch on one device: DDP's Join rule, step k's gradient is the sum over the ranks still
    training, divided by the world size."""
    world = len(batches)
    optimizer = torch.optim.SGD(start.parameters(), lr=0.1)
    for k in range(max(len(b) for b in batches)):
        present = [b[k] for b in batches if k < len(b)]
        optimizer.zero_grad()
        (sum(F.mse_loss(start(x), y) for x, y in present) / world).backward()  # type: ignore[union-attr]
        optimizer.step()
    return start


def check_join(session: Session, accumulate: int, extra: int = 3) -> None:
    """Uneven inputs under join: accumulate=1 trains every rank's batches to the oracle; accumulate > 1 is
    refused on every rank (a rank's last window would close inside another's, unpaired all-reduces: a hang)."""
    world, rank = session.world_size, session.global_rank
    batches = uneven_batches(world, extra=extra)
    torch.manual_seed(11)
    plain = nn.Linear(4, 1)
    start = {k: v.clone() for k, v in plain.state_dict().items()}
    refused = ""
    with Session(strategy="ddp", seed=0, accumulate=accumulate, timeout_s=30) as inner:
        model = inner.setup_model(nn.Linear(4, 1))
        inner.unwrap(model).load_state_dict(start)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            with inner.join(model):
                for x, y in inner.batches(batches[rank], even_batches=False):
                    with inner.micro_step(model):
                        inner.backward(F.mse_loss(model(x), y))
                    inner.step(optimizer)
        except ConfigError as error:
            refused = str(error)
        got = {k: v.detach().clone() for k, v in inner.unwrap(model).state_dict().items()}
    if accumulate > 1:
        agree("Session(accumulate=1)" in refused and f"accumulate={accumulate}" in refused, refused, session)
    else:
        want = join_oracle(batches, plain).state_dict()
        ok = not refused and all(torch.allclose(got[k], v, atol=1e-6) for k, v in want.items())
        agree(ok, f"join with accumulate={accumulate}: {refused or got} vs {dict(want)}", session)
    session.print(f"ok join_accumulate_{accumulate}" + ("" if extra else "_rank0_without_batches"))


def check_loader_attributes(session: Session) -> None:
    """A session loader answers as a DataLoader: the whole dataset, this rank's batch size."""
    world = session.world_size
    data = TensorDataset(torch.arange(6 * world))
    loader = session.setup_dataloader(DataLoader(data, batch_size=2 * world, shuffle=True))
    sizes = {len(batch[0]) for batch in session.batches(loader)}
    ok = loader.dataset is data and len(loader.dataset) == 6 * world and loader.batch_size == 2 and sizes == {2}
    agree(ok, f"loader attributes: batch_size={loader.batch_size}, batches of {sizes}", session)
    session.print("ok loader_attributes")


def main() -> None:
    with Session(strategy="ddp", seed=0) as session:
        for accumulate in (1, 2, 3):
            check_join(session, accumulate)
        check_join(session, 1, extra=0)  # rank 0 has no batch at all: it joins at once
        check_loader_attributes(session)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
