"""Ranks that pass the toolkit's collectives different things: every rank raises the typed error naming each
rank's side, in bounded time, and the ranks stay in step (``disagreement_worker.py`` on 2 and 3 gloo ranks).

Before: gloo moved the bytes as they were (an int32 one read as float32 is 1.4e-45), or a rank with one
tensor more waited in a collective the others never issued. The descriptions and messages themselves are
checked in one process here too (:mod:`multigpu.runtime.agreement`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from multigpu.runtime.agreement import Call, mismatch_message
from tests.launching import launch_workers

WORKER = Path(__file__).with_name("disagreement_worker.py")


def _ranks(first: str, others: str) -> Callable[[int], list[str]]:
    """Rank 0 says ``first``, every other rank ``others``."""
    return lambda world: [f"rank 0: {first}"] + [f"rank {r}: {others}" for r in range(1, world)]


def _each(text: str) -> Callable[[int], list[str]]:
    """Every rank says ``text`` with its rank in ``{r}`` and ``{n}`` (2 + its rank: the worker's sizes)."""
    return lambda world: [text.format(r=r, n=2 + r) for r in range(world)]


MISMATCH = "CollectiveMismatchError"
EXPECTED: dict[str, tuple[str, Callable[[int], list[str]]]] = {
    "gather_dtype": (MISMATCH, _ranks("int32 (2, 3)", "float32 (2, 3)")),
    "gather_trailing": (MISMATCH, lambda world: [f"rank {r}: float32 (2, {3 + r})" for r in range(world)]),
    "gather_ndim": (MISMATCH, _ranks("float32 (4,)", "float32 (2, 2)")),
    "gather_keys": (MISMATCH, _ranks("['b'] is float32 (2, 3) (2 leaves in all)", "nothing there (1 leaf in all)")),
    "gather_tensor_or_none": (MISMATCH, _ranks("['a'] is float32 (2, 3)", "['a'] is None")),
    "gather_list_length": (MISMATCH, lambda world: ["rank 0: nothing there (1 leaf in all)", "rank 1: [1] is float32"]),
    "gather_nested_dtype": (MISMATCH, _ranks("float64 (2, 3)", "float32 (2, 3)")),
    "gather_for_metrics_dtype": (MISMATCH, _ranks("int64 (2, 3)", "float32 (2, 3)")),
    "gather_object_vs_gather": (MISMATCH, _ranks("gather_object", "gather")),
    "reduce_int_or_float": (MISMATCH, _ranks("int32 (2, 3), sent as int64", "float32 (2, 3), sent as float64")),
    "reduce_shape": (MISMATCH, _each("rank {r}: float32 ({n},)")),
    "reduce_large_shape": (MISMATCH, lambda world: [f"rank {r}: float32 ({100 + r},)" for r in range(world)]),
    "reduce_keys": (MISMATCH, _ranks("['loss'] is a number (float)", "['acc'] is a number (float)")),
    "reduce_numpy_shape": (MISMATCH, _each("rank {r}: float32 ({n},)")),
    "reduce_string": ("ConfigError", lambda world: ["cannot be reduced; reduce takes tensors, numbers"]),
    "broadcast_shape": (MISMATCH, _each("rank {r}: float32 ({n},)")),
    "broadcast_dtype": (MISMATCH, _ranks("int32 (2, 3)", "float32 (2, 3)")),
    "broadcast_src": (MISMATCH, _each("rank {r}: broadcast from rank {r}")),
    "broadcast_object_src": (MISMATCH, _each("rank {r}: broadcast_object from rank {r}")),
    "pad_ndim": (MISMATCH, _ranks("float32 (3,)", "float32 (3, 1)")),
    "pad_keys": (MISMATCH, _ranks("['a'] is float32 (2, 3)", "['b'] is float32 (2, 3)")),
    "gather_or_reduce": (MISMATCH, _ranks("gather", "reduce (mean)")),
    "gather_by_index_dtype": (MISMATCH, _ranks("int32 (2, 3)", "float32 (2, 3)")),
    "split_reduce_dtype": (MISMATCH, _ranks("int64 (1,)", "float32 (1,), sent as float64")),
    "even_batches_kinds": (
        MISMATCH,
        _ranks("reduce (min) of the batch count (every rank has a len())", "reduce (min) of the next-batch flag"),
    ),
    "trigger_or_reduce": (MISMATCH, _ranks("reduce (max) of the trigger", "reduce (max)")),
    "gather_by_index_rows": ("ConfigError", lambda world: ["rank 1's values has 3 rows but indices has 2"]),
}


@pytest.fixture(scope="module", params=[2, 3])
def records(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp(f"disagree{request.param}")
    launch_workers(WORKER, str(out), nproc=request.param, timeout_s=240)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(request.param)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_every_rank_refuses_what_the_ranks_disagree_on(records: list[dict[str, Any]], case: str) -> None:
    kind, fragments = EXPECTED[case]
    world = len(records)
    for rank, record in enumerate(records):
        got = record[case]
        assert got["type"] == kind, (rank, got)
        message = got["message"]
        for fragment in fragments(world):
            assert fragment in message, (rank, fragment, message)
        if kind == MISMATCH and "collectives" not in message:
            assert f"(seen on rank {rank})" in message and "Fix:" in message, message
        assert got["seconds"] < 10 and got["in_step"], (rank, got)  # bounded (the timeout is 20 s), still in step


@pytest.mark.multiprocess
def test_a_main_process_that_raises_first_releases_the_others(records: list[dict[str, Any]]) -> None:
    assert records[0]["main_first_raises"]["type"] == "OSError"
    for record in records[1:]:
        got = record["main_first_raises"]
        assert got["type"] == "PeerExitedError" and "raised inside main_process_first()" in got["message"], got
        assert got["seconds"] < 10 and got["in_step"], got


@pytest.mark.multiprocess
def test_a_stop_flag_that_meets_another_collective_is_refused(records: list[dict[str, Any]]) -> None:
    got = records[0]["stop_flag_meets_another"]  # rank 0 polled while rank 1 all-reduced a 5 of its own
    assert (
        got["type"] == MISMATCH
        and "the stop flag's all-reduce on rank 0 came back as 5.0, not 0 or 1" in got["message"]
    )


def test_descriptions_agree_on_what_each_collective_needs() -> None:
    def call(tensor: torch.Tensor, match: Any) -> Call:
        return Call.of("op", [("", tensor)], match=match)

    rows = (torch.ones(2, 3), torch.ones(5, 3))  # rows may differ in a gather, not in a broadcast
    assert call(rows[0], "trailing").digest == call(rows[1], "trailing").digest
    assert call(rows[0], "all").digest != call(rows[1], "all").digest
    assert call(torch.ones(2, 3), "ndim").digest == call(torch.ones(4, 1, dtype=torch.int8), "ndim").digest
    for match in ("trailing", "all", "ndim"):
        assert call(torch.ones(2, 3), match).digest != call(torch.ones(2, 3, 1), match).digest
    assert call(torch.ones(2), "all").digest != call(torch.ones(2, dtype=torch.int32), "all").digest
    text = mismatch_message([call(torch.ones(2), "all"), call(torch.ones(2, dtype=torch.int32), "all")], 1)
    assert "rank 0: float32 (2,)\n  rank 1: int32 (2,)" in text and "(seen on rank 1)" in text
