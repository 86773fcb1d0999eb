"""Worker for the loop toolkit's multi-process tests: every check in one launched job (launches are slow).

    multigpu launch --strategy ddp --nproc-per-node 2 tests/session/toolkit_worker.py OUT_DIR [--examples N]

Each check runs on every rank with the same inputs (hypothesis, derandomized, no shrinking, so
every rank draws the same examples in the same order); a check's verdict is agreed between the
ranks before anyone raises, so a failure fails every rank at the same point instead of leaving
the others waiting in a collective. Rank 0 prints ``ok NAME`` per check passed; the test reads them.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from multigpu import Checkpointer
from multigpu.session import Session

ARGS = argparse.Namespace()


def agree(ok: bool, what: str, session: Session) -> None:
    """Fail on every rank when ``ok`` is false on any (so no rank waits in a later collective)."""
    if session.reduce(0.0 if ok else 1.0, "max") > 0:
        raise AssertionError(f"{what} failed on some rank (this rank: {'ok' if ok else 'FAILED'})")


def passed(session: Session, name: str) -> None:
    session.print(f"ok {name}")


@dataclass
class Pair:
    rows: torch.Tensor
    label: str


def check_rank_streams(session: Session) -> None:
    """Break 2: identical initial weights, independent dropout masks by default; the same masks when asked."""
    for per_rank in (True, False):
        with Session(strategy="ddp", seed=4, seed_per_rank=per_rank) as inner:
            model = inner.setup_model(nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5)))
            weights = torch.cat([p.detach().flatten() for p in model.parameters()])
            first = inner.gather(weights.unsqueeze(0))
            agree(all(torch.equal(first[0], row) for row in first), "identical initial weights", session)
            mask = F.dropout(torch.ones(4000), 0.5) > 0
            masks = inner.gather(mask.unsqueeze(0).to(torch.uint8)).bool()
            agreement = (masks[0] == masks[1]).float().mean().item()
            want_ok = 0.45 < agreement < 0.55 if per_rank else agreement == 1.0
            agree(want_ok, f"dropout mask agreement {agreement:.3f} (seed_per_rank={per_rank})", session)
    passed(session, "rank_streams")


def check_collectives(session: Session) -> None:
    world, rank = session.world_size, session.global_rank
    mine = torch.arange(rank + 1) + 10 * rank  # a different first dimension per rank
    want = torch.cat([torch.arange(r + 1) + 10 * r for r in range(world)])
    got = session.gather({"ids": mine, "pair": Pair(rows=mine.float(), label="x"), "scalar": torch.tensor(rank)})
    ok = torch.equal(got["ids"], want) and torch.equal(got["pair"].rows, want.float()) and got["pair"].label == "x"
    ok = ok and torch.equal(got["scalar"], torch.arange(world))
    agree(ok, "gather", session)
    agree(session.gather_object({"rank": rank}) == [{"rank": r} for r in range(world)], "gather_object", session)
    sent = session.broadcast([torch.full((2, 3), float(rank)), "keep"], src=world - 1)
    agree(torch.equal(sent[0], torch.full((2, 3), float(world - 1))) and sent[1] == "keep", "broadcast", session)
    obj = session.broadcast_object({"from": rank, "list": [rank] * 3}, src=1)
    agree(obj == {"from": 1, "list": [1, 1, 1]}, "broadcast_object", session)
    reduced = session.reduce({"v": torch.tensor([rank, 2.0 * rank]), "n": [torch.tensor(rank)]}, "sum")
    total = sum(range(world))
    ok = torch.equal(reduced["v"], torch.tensor([total, 2.0 * total])) and int(reduced["n"][0]) == total
    agree(ok, "reduce nested (sum)", session)
    agree(
        torch.equal(session.reduce(torch.tensor([rank, 1]), "max"), torch.tensor([world - 1, 1])), "reduce max", session
    )
    agree(session.reduce(float(rank)) == total / world, "reduce scalar", session)
    # numpy's numbers and arrays were returned unreduced; 0-dim tensors and bools reduce like numbers
    numpy_like = session.reduce({"f32": np.float32(rank), "i64": np.int64(rank), "flag": rank == 0}, "sum")
    ok = numpy_like == {"f32": float(total), "i64": float(total), "flag": 1.0}
    array = session.reduce(np.arange(3, dtype=np.int32) * rank, "sum")
    ok = ok and isinstance(array, np.ndarray) and array.dtype == np.int32 and array.tolist() == [0, total, 2 * total]
    ok = ok and session.reduce(np.float32(rank), "max") == world - 1 and session.reduce(torch.tensor(rank), "min") == 0
    agree(ok, f"reduce numpy and 0-dim ({numpy_like}, {array})", session)
    # past the header's payload: the header, then an all-reduce; 35 tensors: sizes in two headers
    big = session.reduce({"f": torch.arange(100.0) * rank, "i": torch.full((40,), 2**60 + rank)}, "sum")
    ok = torch.equal(big["f"], torch.arange(100.0) * total) and big["i"].tolist() == [world * 2**60 + total] * 40
    many = session.gather([torch.full((rank + 1,), i) for i in range(35)])
    ok = ok and all(torch.equal(m, torch.full((world * (world + 1) // 2,), i)) for i, m in enumerate(many))
    padded_many = session.pad_across_processes([torch.ones(rank + 1) for _ in range(35)])
    agree(ok and all(p.shape == (world,) for p in padded_many), "reduce, gather and pad past the header", session)
    # dtypes gloo has no all-gather of its own travel as bytes
    odd = session.gather({"i16": torch.full((rank + 1, 2), rank, dtype=torch.int16), "c": torch.tensor([1j * rank])})
    want16 = torch.cat([torch.full((r + 1, 2), r, dtype=torch.int16) for r in range(world)])
    ok = torch.equal(odd["i16"], want16) and torch.equal(odd["c"], torch.tensor([1j * r for r in range(world)]))
    sent16 = session.broadcast(torch.full((2,), rank, dtype=torch.int16), src=world - 1)
    agree(ok and sent16.tolist() == [world - 1] * 2, "gather and broadcast of int16 and complex", session)
    padded = session.pad_across_processes(torch.ones(rank + 1, 2), dim=0, pad_index=-1)
    ok = padded.shape == (world, 2) and bool((padded[rank + 1 :] == -1).all()) and bool((padded[: rank + 1] == 1).all())
    first = session.pad_across_processes(torch.ones(2, rank + 1), dim=1, pad_first=True)
    ok = ok and first.shape == (2, world) and bool((first[:, : world - rank - 1] == 0).all())
    agree(ok, "pad_across_processes", session)
    passed(session, "collectives")


def check_split(session: Session) -> None:
    @settings(max_examples=ARGS.examples, derandomize=True, deadline=None, database=None, phases=[Phase.generate])
    @given(n=st.integers(0, 23), padding=st.booleans())
    def check(n: int, padding: bool) -> None:
        items = [f"item{i}" for i in range(n)]
        with session.split_between_processes(items, apply_padding=padding) as share:
            shares = session.gather_object(share)
        with session.split_between_processes({"t": torch.arange(n), "l": items}) as both:
            tensors = session.gather_object(both["t"])
        # plain torch: contiguous chunks, the first n % W one longer (torch.tensor_split's rule)
        chunks = [c.tolist() for c in torch.tensor_split(torch.arange(n), session.world_size)]
        unpadded = [[items[i] for i in c] for c in chunks]
        want = [w + items[-1:] * (len(unpadded[0]) - len(w)) for w in unpadded] if padding else unpadded
        ok = shares == want and [t.tolist() for t in tensors] == chunks and both["l"] == unpadded[session.global_rank]
        agree(ok, f"split_between_processes(n={n}, padding={padding}): {shares}", session)

    check()
    passed(session, "split_between_processes")


def check_gather_for_metrics(session: Session) -> None:
    world = session.world_size

    @settings(max_examples=ARGS.examples, derandomize=True, deadline=None, database=None, phases=[Phase.generate])
    @given(n=st.integers(world, 29), per_rank=st.integers(1, 4), shuffle=st.booleans(), drop_last=st.booleans())
    def check(n: int, per_rank: int, shuffle: bool, drop_last: bool) -> None:
        global_batch = per_rank * world
        if drop_last and n < global_batch:
            return
        dataset = TensorDataset(torch.arange(n), torch.arange(n) * 2)
        loader = session.setup_dataloader(
            DataLoader(dataset, batch_size=global_batch, shuffle=shuffle, drop_last=drop_last)
        )
        got, texts = [], []
        for i, t in session.batches(loader):  # generated strings: one per sample, in a list (or a tuple) of their own
            texts_of_rank = [f"s{v}" for v in i.tolist()]
            got.append(session.gather_for_metrics({"id": i, "twice": t, "text": texts_of_rank, "np": i.numpy() * 3}))
            texts += session.gather_for_metrics(tuple(f"s{v}" for v in i.tolist()))
        ids = torch.cat([g["id"] for g in got])
        twice = torch.cat([g["twice"] for g in got])
        text = [s for g in got for s in g["text"]]
        # plain torch on one device: the same DataLoader settings and the same epoch-0 permutation
        order = torch.randperm(n, generator=torch.Generator().manual_seed(0)) if shuffle else torch.arange(n)
        one_device = torch.cat([b for b in DataLoader(order, batch_size=global_batch, drop_last=drop_last)])
        ok = torch.equal(ids, one_device) and torch.equal(twice, one_device * 2)
        ok = ok and text == texts == [f"s{v}" for v in one_device.tolist()]  # were this rank's own strings
        ok = ok and np.array_equal(np.concatenate([g["np"] for g in got]), one_device.numpy() * 3)  # and arrays
        agree(ok, f"gather_for_metrics(n={n}, batch={global_batch}, shuffle={shuffle}, drop_last={drop_last})", session)

    check()
    passed(session, "gather_for_metrics")


def check_own_batch_sampler(session: Session) -> None:
    """Break 3: a user's own sharded batch sampler passes session.batches; every sample comes once."""
    world, rank = session.world_size, session.global_rank
    batches = [list(range(i, min(i + 2, 11))) for i in range(0, 11, 2)]
    own = DataLoader(TensorDataset(torch.arange(11)), batch_sampler=batches[rank::world])  # this rank's batches
    seen = [int(i) for (ids,) in session.batches(own) for i in ids]
    everyone = sorted(i for ids in session.gather_object(seen) for i in ids)
    steps = min(len(batches[r::world]) for r in range(world))  # the ranks stop together at the shortest
    agree(
        everyone == sorted(i for r in range(world) for b in batches[r::world][:steps] for i in b),
        "own batch sampler",
        session,
    )
    passed(session, "own_batch_sampler")


def check_evaluate_padding(session: Session) -> None:
    calls = []
    n = 2 * session.world_size + 1  # does not divide: the last ranks evaluate a repeat
    result = session.evaluate(
        lambda batch: calls.append(len(batch[0])) or batch[0] * 3, TensorDataset(torch.arange(n)), 4
    )
    evaluated = session.reduce(float(sum(calls)), "sum")
    padded = -(-n // session.world_size) * session.world_size
    agree(torch.equal(result, torch.arange(n) * 3) and evaluated == padded, "evaluate with padding", session)
    passed(session, "evaluate_padding")


def check_process_order(session: Session) -> None:
    marker = Path(ARGS.out) / "made-by-main"
    with session.main_process_first():
        if session.is_main_process:
            time.sleep(0.3)  # the others would see no marker if they did not wait
            marker.write_text("done")
        seen = marker.exists()
    agree(seen, "main_process_first", session)
    local = Path(ARGS.out) / "made-by-local-main"
    with session.local_main_process_first():
        if session.is_local_main_process:
            time.sleep(0.3)
            local.write_text("done")
        seen = local.exists()
    agree(seen and session.is_local_main_process == (session.local_rank == 0), "local_main_process_first", session)
    # nested: one block; the others enter the outer block after the main process has left it (they entered
    # it when rank 0 left the inner one, and ran its start while rank 0 was still inside)
    outer = Path(ARGS.out) / "outer-block-done"
    with session.main_process_first():
        with session.main_process_first():
            pass
        if session.is_main_process:
            time.sleep(0.3)
            outer.write_text("done")
        seen = outer.exists()
    agree(seen, "nested main_process_first", session)
    passed(session, "process_order")


def check_trigger(session: Session) -> None:
    stopped_at = None
    for step in range(10):
        if session.global_rank == session.world_size - 1 and step == 3:
            session.set_trigger()
        if session.check_trigger():
            stopped_at = step
            break
    agree(stopped_at == 3 and not session.check_trigger(), f"trigger (stopped at {stopped_at})", session)
    passed(session, "trigger")


def check_join(session: Session) -> None:
    """Uneven inputs: rank r has 2 + r batches; DDP under Join against a plain-torch oracle of the same steps."""
    world = session.world_size
    gen = torch.Generator().manual_seed(7)
    per_rank = [
        [(torch.randn(3, 4, generator=gen), torch.randn(3, 1, generator=gen)) for _ in range(2 + r)]
        for r in range(world)
    ]
    torch.manual_seed(11)
    plain = nn.Linear(4, 1)
    start = {k: v.clone() for k, v in plain.state_dict().items()}
    model = session.setup_model(nn.Linear(4, 1))
    session.unwrap(model).load_state_dict(start)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    with session.join(model):
        for x, y in session.batches(per_rank[session.global_rank], even_batches=False):
            with session.micro_step(model):
                session.backward(F.mse_loss(model(x), y))
            session.step(optimizer)
            steps += 1
    # one device: step k's gradient is the sum of the ranks still training, divided by the world size (DDP's Join)
    oracle = torch.optim.SGD(plain.parameters(), lr=0.1)
    for k in range(max(len(b) for b in per_rank)):
        present = [b[k] for b in per_rank if k < len(b)]
        loss = sum(F.mse_loss(plain(x), y) for x, y in present) / world
        oracle.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        oracle.step()
    got = session.unwrap(model).state_dict()
    ok = steps == 2 + session.global_rank and all(
        torch.allclose(got[k], v, atol=1e-6) for k, v in plain.state_dict().items()
    )
    agree(ok, f"join with uneven inputs ({steps} steps)", session)
    passed(session, "join")


def train_with_dropout(folder: Path, *, stop_at: int | None) -> dict[str, torch.Tensor] | None:
    """Break 1 on several ranks: save mid-epoch at ``stop_at``; or resume from ``folder`` and train to the end."""
    with Session(strategy="ddp", seed=0) as session:  # a fresh session: each rank's own dropout stream
        model = session.setup_model(nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        gen, n = torch.Generator().manual_seed(3), 12 * session.world_size
        data = TensorDataset(torch.randn(n, 5, generator=gen), torch.randint(0, 3, (n,), generator=gen))
        loader = session.build_loader(data, batch_size=2 * session.world_size)  # 6 steps per epoch
        return resume_and_train(session, model, optimizer, loader, folder, stop_at=stop_at)


def resume_and_train(
    session: Session,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: Any,
    folder: Path,
    *,
    stop_at: int | None,
    steps: int = 14,
) -> dict[str, torch.Tensor] | None:
    """Resume from ``folder`` (if it holds a step) and train to ``steps``: None after saving at ``stop_at``,
    else the final weights on the CPU (the mid-epoch resume checks, here and in test_accelerate_semantics)."""
    checkpointer = Checkpointer(folder=folder)
    resumed = checkpointer.resume(model=model, optimizer=optimizer, loader=loader)
    step = resumed.step if resumed else 0
    while step < steps:
        for x, y in session.batches(loader):
            with session.micro_step(model):
                session.backward(F.cross_entropy(model(x), y))
            session.step(optimizer)
            step += 1
            if step == stop_at:
                checkpointer.save(step=step, model=model, optimizer=optimizer, loader=loader)
                return None
            if step == steps:
                break
    return {k: v.detach().cpu().clone() for k, v in session.unwrap(model).state_dict().items()}


def check_resume(session: Session) -> None:
    out = Path(ARGS.out)
    whole = train_with_dropout(out / "whole", stop_at=None)
    train_with_dropout(out / "split", stop_at=8)  # epoch 1, batch 2
    rest = train_with_dropout(out / "split", stop_at=None)
    assert whole is not None and rest is not None
    agree(all(torch.equal(whole[k], rest[k]) for k in whole), "resume mid-epoch with dropout", session)
    passed(session, "resume")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--examples", type=int, default=8)
    parser.parse_args(namespace=ARGS)
    with Session(strategy="ddp", seed=0) as session:
        for check in (
            check_rank_streams,
            check_collectives,
            check_split,
            check_gather_for_metrics,
            check_own_batch_sampler,
            check_evaluate_padding,
            check_process_order,
            check_trigger,
            check_join,
            check_resume,
        ):
            began = time.perf_counter()
            check(session)
            session.print(f"seconds {check.__name__} {time.perf_counter() - began:.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
