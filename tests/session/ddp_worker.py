"""Worker for the multi-process session tests: run every scenario in one launched job (launches are slow).

    multigpu launch --strategy ddp --nproc-per-node 2 tests/session/ddp_worker.py OUT_DIR CASES.json

Each rank writes OUT_DIR/rank<R>.pt with one entry per scenario; the tests compare them with plain
single-device PyTorch (tests/session/oracle.py). ``fuzz`` holds the final weights of every case
of CASES.json (the differential fuzzer's drawn cases, tests/session/fuzz_cases.py), each trained
with a fresh ddp Session in the same process group.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from fuzz_cases import Case, run_case
from oracle import build_model, regression_data

from multigpu.errors import ConfigError
from multigpu.session import Session


def train(
    session: Session, dataset: TensorDataset, global_batch: int, lr: float = 0.2, *, own_loader: bool = False
) -> dict[str, Any]:
    model = session.setup_model(build_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    if own_loader:  # the user's one-device DataLoader, rebuilt: same global batches as build_loader
        loader: Any = session.setup_dataloader(DataLoader(dataset, batch_size=global_batch, shuffle=True))
    else:
        loader = session.build_loader(dataset, batch_size=global_batch)
    losses, steps = [], 0
    for _ in range(2):
        for x, y in session.batches(loader):
            with session.micro_step(model):
                loss = F.mse_loss(model(x), y)
                session.backward(loss)
            steps += session.step(optimizer)
            losses.append(session.reduce(loss.detach()))
    return {"state_dict": session.unwrap(model).state_dict(), "losses": losses, "steps": steps}


class Stream(IterableDataset):  # type: ignore[type-arg]
    """``count`` zeros; a DataLoader over it is Sized by type, but its len() raises TypeError."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter([torch.zeros(1)] * self.count)


def uneven(session: Session) -> dict[str, Any]:
    mine = 3 if session.global_rank == 0 else 5
    sized = sum(1 for _ in session.batches([torch.zeros(1)] * mine))
    unsized = sum(1 for _ in session.batches(torch.zeros(1) for _ in range(mine)))
    stream = sum(1 for _ in session.batches(DataLoader(Stream(mine), batch_size=1)))
    return {"sized": sized, "unsized": unsized, "stream_loader": stream}


class Numbers(IterableDataset):  # type: ignore[type-arg]
    """The stream 0, 1, ..., count - 1 (the same on every rank: setup_dataloader strides it)."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(torch.tensor(i) for i in range(self.count))


def strided_stream(session: Session) -> list[list[int]]:
    """This rank's batches of a 10-item stream set up as global batches of 4 (drop_last)."""
    loader = session.setup_dataloader(DataLoader(Numbers(10), batch_size=4, drop_last=True))
    return [batch.tolist() for batch in session.batches(loader)]


def epochs(session: Session) -> dict[str, Any]:
    loader = session.build_loader(TensorDataset(torch.arange(10)), batch_size=2)
    # 23 samples, global batch 8: one device takes 2 steps; padding to 24 once gave ddp a third
    ragged = session.build_loader(TensorDataset(torch.arange(23)), batch_size=8)
    return {
        "epoch0": [int(i) for (b,) in loader for i in b],
        "epoch1": [int(i) for (b,) in loader for i in b],
        "ragged": [[int(i) for i in b] for (b,) in session.batches(ragged)],
    }


def unsharded_refused(session: Session, dataset: TensorDataset) -> str:
    """The error a one-device DataLoader gets from session.batches under ddp (it trained every sample on every rank)."""
    try:
        for _ in session.batches(DataLoader(dataset, batch_size=8, shuffle=True)):
            pass
    except ConfigError as exc:
        return str(exc)
    return "not refused"


def main() -> None:
    out = Path(sys.argv[1])
    dataset = regression_data(32)
    with Session(strategy="ddp", timeout_s=60) as session:
        results: dict[str, Any] = {"world_size": session.world_size, "rank": session.global_rank}
        results["fp32"] = train(session, dataset, global_batch=8)
        results["own_loader"] = train(Session(strategy="ddp").start(), dataset, global_batch=8, own_loader=True)
        results["unsharded_refused"] = unsharded_refused(session, dataset)
        # Further configurations share the process group the first session opened.
        results["accumulate"] = train(Session(strategy="ddp", accumulate=2).start(), dataset, global_batch=8)
        # 4 batches per epoch in windows of 3: the short window (1 batch) must sync and step.
        results["accumulate_short"] = train(Session(strategy="ddp", accumulate=3).start(), dataset, global_batch=8)
        inner = Session(strategy="ddp").start()
        inner.close()  # it joined the group the outer session created: closing must not end it
        results["group_kept"] = torch.distributed.is_initialized() and session.reduce(1.0, "sum") == 2.0
        for precision in ("bf16", "fp16"):
            results[precision] = train(Session(strategy="ddp", precision=precision).start(), dataset, 8, lr=0.1)
        results["uneven"] = uneven(session)
        results["strided_stream"] = strided_stream(session)
        results["epochs"] = epochs(session)
        eleven = TensorDataset(torch.arange(11.0))
        results["evaluate"] = session.evaluate(lambda batch: batch[0] * 2, eleven, batch_size=4)
        value = session.global_rank + 1.0
        results["reduce"] = {op: session.reduce(value, op) for op in ("mean", "sum", "max", "min")}
        results["ranks"] = (session.rank, session.global_rank, session.local_rank)
        logged = Session(strategy="ddp", run_dir=out / "run").start()
        for step in range(3):  # every rank logs; only the main process writes
            logged.log({"loss": float(step), "rank": float(session.global_rank)}, step)
        logged.close()
        cases = [Case.from_json(data) for data in json.loads(Path(sys.argv[2]).read_text())]
        results["fuzz"] = [run_case(case, "ddp") for case in cases]
        torch.save(results, out / f"rank{session.global_rank}.pt")


if __name__ == "__main__":
    main()
