"""Worker for test_disagreement.py: ranks that pass the toolkit different things, on real gloo ranks, in one launch.

    multigpu launch --strategy ddp --nproc-per-node 2 tests/session/disagreement_worker.py OUT_DIR

Each case has every rank pass something of its own (rank 0 one dtype, the others another; a key only
rank 0 has; a src each rank names differently...). Every rank records, per case, the error it got (type
and message) in ``OUT_DIR/rank-R.json``; the test asserts that every rank raised the typed error naming
every rank's side. The collective timeout is short, so a case that would hang shows up as a
``CollectiveTimeoutError`` in the record instead of a stuck run. After each case a plain reduce checks
that the group still works (a refused call must leave the ranks in step).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from multigpu.runtime import exchange
from multigpu.runtime.collectives import gather_by_index
from multigpu.runtime.data import even_batches
from multigpu.runtime.preemption import StopAgreement
from multigpu.session import Session


def cases(session: Session) -> dict[str, Callable[[], Any]]:
    rank = session.global_rank
    first = rank == 0
    ones = torch.ones(2, 3)
    return {
        "gather_dtype": lambda: session.gather(ones.int() if first else ones),
        "gather_trailing": lambda: session.gather(torch.ones(2, 3 + rank)),
        "gather_ndim": lambda: session.gather(torch.ones(4) if first else torch.ones(2, 2)),
        "gather_keys": lambda: session.gather({"a": ones, "b": ones} if first else {"a": ones}),
        "gather_tensor_or_none": lambda: session.gather({"a": ones if first else None}),
        "gather_list_length": lambda: session.gather([ones] * (1 + rank)),
        "gather_nested_dtype": lambda: session.gather({"x": [ones, ones.double() if first else ones]}),
        "gather_for_metrics_dtype": lambda: session.gather_for_metrics(ones.long() if first else ones),
        "gather_object_vs_gather": lambda: session.gather_object("x") if first else session.gather(ones),
        "reduce_int_or_float": lambda: session.reduce(ones.int() if first else ones, "sum"),
        "reduce_shape": lambda: session.reduce(torch.ones(2 + rank)),
        "reduce_large_shape": lambda: session.reduce(torch.ones(100 + rank)),
        "reduce_keys": lambda: session.reduce({"loss": 1.0} if first else {"acc": 1.0}),
        "reduce_numpy_shape": lambda: session.reduce(np.ones(2 + rank, dtype=np.float32)),
        "reduce_string": lambda: session.reduce({"loss": 1.0, "name": "x" if first else None}),
        "broadcast_shape": lambda: session.broadcast(torch.ones(2 + rank)),
        "broadcast_dtype": lambda: session.broadcast(ones.int() if first else ones),
        "broadcast_src": lambda: session.broadcast(ones, src=rank),
        "broadcast_object_src": lambda: session.broadcast_object("x", src=rank),
        "pad_ndim": lambda: session.pad_across_processes(torch.ones(3) if first else torch.ones(3, 1)),
        "pad_keys": lambda: session.pad_across_processes({"a": ones} if first else {"b": ones}),
        "gather_or_reduce": lambda: session.gather(ones) if first else session.reduce(ones),
        "gather_by_index_dtype": lambda: gather_by_index(
            ones.int() if first else ones, torch.tensor([rank, rank]), 2 * session.world_size
        ),
        "split_reduce_dtype": lambda: exchange.reduce(
            [np.int64(rank), torch.ones(1, dtype=torch.int64 if first else torch.float32)], "max"
        ),
        "main_first_raises": lambda: _main_first_raises(session),
        "even_batches_kinds": lambda: list(even_batches([1, 2, 3] if first else iter([1, 2, 3]))),
        "trigger_or_reduce": lambda: session.check_trigger() if first else session.reduce(0.0, "max"),
        "gather_by_index_rows": lambda: gather_by_index(torch.ones(2 if first else 3), torch.tensor([rank, rank]), 9),
        "stop_flag_meets_another": lambda: _stop_flag_meets_another(first),
    }


def _stop_flag_meets_another(first: bool) -> None:
    if first:
        agreement = StopAgreement()
        agreement.poll(False)
        agreement.finish()
    else:  # a collective of the user's own where rank 0 polls
        torch.distributed.all_reduce(torch.tensor([5.0]), op=torch.distributed.ReduceOp.MAX)


def _main_first_raises(session: Session) -> None:
    with session.main_process_first():
        if session.is_main_process:
            raise OSError("the download failed")


def main() -> None:
    out = Path(sys.argv[1])
    records: dict[str, dict[str, Any]] = {}
    with Session(strategy="ddp", seed=0, timeout_s=20) as session:
        for name, case in cases(session).items():
            began = time.monotonic()
            try:
                case()
                record = {"type": "", "message": ""}
            except Exception as exc:  # recorded: the test asserts which
                record = {"type": type(exc).__name__, "message": str(exc)}
            record["seconds"] = round(time.monotonic() - began, 2)
            record["in_step"] = session.reduce(1.0, "sum") == session.world_size  # the group still works
            records[name] = record
        rank = session.global_rank
    (out / f"rank-{rank}.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
