"""When a ddp run goes wrong, the launcher names the rank, the place and the reason (real gloo workers).

Each case runs tests/launcher/forensics_worker.py on two processes through ``multigpu launch``:
a rank stuck (sleeping, in a busy Python loop, in a C call) while the other waits in a reduce; a
collective of another shape or in another order, with and without ``--debug``; a parameter without
gradient; the log options. The default suite runs a stuck rank in a Python loop (rank 0) and in a C call
(rank 1); ``MULTIGPU_LONG=1`` runs every kind on every rank, and the order mismatch under ``--debug``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.launching import multigpu_launch

WORKER = Path(__file__).with_name("forensics_worker.py")
TIMEOUT = "4"  # seconds a collective waits: short, so each hang costs a few seconds
_LONG = os.environ.get("MULTIGPU_LONG") == "1"


def _line(marker: str) -> int:
    """The line of the worker that holds ``marker`` (so the tests do not hard-code line numbers)."""
    for number, text in enumerate(WORKER.read_text().splitlines(), start=1):
        if marker in text:
            return number
    raise AssertionError(f"no {marker!r} in {WORKER}")


def _launch(*args: str) -> tuple[str, str]:
    done = multigpu_launch("--strategy", "ddp", "--nproc-per-node", "2", *args, timeout_s=150)
    assert done.returncode == 1, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    summary = done.stderr[done.stderr.rindex("multigpu launch: ") :]
    return summary, done.stderr


_FUNCTIONS = {"sleep": "stuck_in_sleep", "busy": "stuck_in_busy_loop", "native": "stuck_in_native_code"}
# each rank once in the default suite (a Python loop on rank 0, a C call on rank 1); every pair when long
_CASES = [(kind, rank) for kind in _FUNCTIONS for rank in (0, 1)] if _LONG else [("busy", 0), ("native", 1)]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("kind", "stuck"), _CASES)
def test_a_hang_names_the_rank_that_never_arrived_with_its_stack(kind: str, stuck: int) -> None:
    summary, _ = _launch("--collective-timeout", TIMEOUT, str(WORKER), kind, str(stuck))
    waiter = 1 - stuck
    lead = summary.splitlines()[0]
    assert re.match(
        rf"multigpu launch: \S*forensics_worker.py hung: rank {stuck} never reached collective #2, reduce \(mean\) "
        rf"at forensics_worker.py:{_line('# WAITED IN')}, which rank {waiter} waited in from \d\d:\d\d:\d\d for "
        rf"[\d.]+ s until the collective timeout; rank {stuck} was at forensics_worker.py:\d+ in {_FUNCTIONS[kind]}$",
        lead,
    ), summary
    if kind != "busy":  # a busy loop is caught on whichever line of the loop it is running
        assert lead.endswith(f"forensics_worker.py:{_line('# STUCK: ' + kind)} in {_FUNCTIONS[kind]}"), lead
    # its last collective, then its stack from the script down, innermost last and marked
    assert f"Rank {stuck} never arrived (its last collective was #1, reduce (mean) at forensics_worker.py:" in summary
    stack = summary.split(f"Rank {stuck} never arrived")[1].split("\n\n")[0].splitlines()[1:]
    assert stack[0].strip().startswith(f'File "{WORKER}", line {_line("main(sys.argv[1]")}, in <module>'), stack
    assert any(f"in {_FUNCTIONS[kind]}  <- here" in line for line in stack), stack
    # the rank that waited is a consequence, and the summary says where to read more
    consequences = summary.split("Ranks that timed out waiting for it (consequences):\n")[1].splitlines()
    assert consequences[0].startswith(f"  rank {waiter} (local_rank {waiter}, exit code 1): CollectiveTimeoutError")
    assert summary.rstrip().endswith("docs/distributed.md, section 'When a run hangs or a collective fails'")


@pytest.mark.multiprocess
def test_a_shape_mismatch_carries_the_backend_s_words_and_the_debug_hint() -> None:
    summary, _ = _launch(str(WORKER), "raw_shape")  # a collective of the user's own: gloo aborts
    assert "Signal 6 (SIGABRT)" in summary.splitlines()[0]
    assert "Is there a distributed collective mismatch in your code?" in summary
    assert f"Python was at forensics_worker.py:{_line('# MISMATCH: raw shape')} in main" in summary
    assert "rerun with 'multigpu launch --debug' (or Session(debug=True))" in summary


@pytest.mark.multiprocess
def test_without_debug_the_session_refuses_a_shape_mismatch_on_every_rank() -> None:
    summary, stderr = _launch(str(WORKER), "shape")  # the session's reduce agrees on shapes first
    assert "CollectiveMismatchError: reduce (mean) got tensors that do not fit together" in summary
    assert "rank 0: float32 (3,), sent as float64" in summary and "rank 1: float32 (5,), sent as float64" in summary
    assert "SIGABRT" not in stderr and stderr.count("CollectiveMismatchError") >= 2  # both ranks raised it


@pytest.mark.multiprocess
def test_with_debug_a_shape_mismatch_names_each_rank_s_shape_and_line() -> None:
    summary, _ = _launch("--debug", str(WORKER), "shape")
    line = _line("# MISMATCH: shape")
    assert "CollectiveMismatchError: the ranks issued different collectives at collective #3" in summary
    assert f"rank 0: reduce (mean) shape (3,) float64 at forensics_worker.py:{line}" in summary
    assert f"rank 1: reduce (mean) shape (5,) float64 at forensics_worker.py:{line}" in summary


@pytest.mark.multiprocess
def test_without_debug_collectives_in_another_order_are_named_from_the_ledgers() -> None:
    summary, _ = _launch("--collective-timeout", TIMEOUT, str(WORKER), "order")
    assert summary.splitlines()[0].endswith(
        f"hung: the ranks waited in different collectives at #2 (rank 0: reduce (mean) at forensics_worker.py:"
        f"{_line('# MISMATCH: reduce')}; rank 1: barrier at forensics_worker.py:{_line('# MISMATCH: barrier')}) "
        "until the collective timeout: a collective issued in a different order, or on some ranks only"
    ), summary
    assert "rerun with 'multigpu launch --debug'" in summary


@pytest.mark.multiprocess
@pytest.mark.skipif(not _LONG, reason="MULTIGPU_LONG=1: the --debug check is covered by the shape case by default")
def test_with_debug_collectives_in_another_order_fail_at_once_on_every_rank() -> None:
    summary, _ = _launch("--debug", str(WORKER), "order")
    assert f"rank 0: reduce (mean) shape () float64 at forensics_worker.py:{_line('# MISMATCH: reduce')}" in summary
    assert f"rank 1: barrier at forensics_worker.py:{_line('# MISMATCH: barrier')}" in summary
    # every rank raises its own error; whether rank 1 exits (code 1) before the launcher's SIGTERM for rank 0's
    # failure reaches it (-15) is timing, and its own recorded error is named either way
    assert re.search(r"rank 1 \(local_rank 1, exit code (1|-15)\): CollectiveMismatchError", summary), summary


@pytest.mark.multiprocess
def test_an_unused_parameter_is_named_with_its_module() -> None:
    summary, _ = _launch(str(WORKER), "unused")
    assert "received no gradient in the previous step: spare.0.weight (in spare.0: Linear), " in summary
    assert "spare.0.bias (in spare.0: Linear)" in summary
    assert "DDPOptions(find_unused_parameters=True)" in summary


@pytest.mark.multiprocess
def test_log_dir_keeps_every_rank_and_the_console_shows_the_filtered_streams(tmp_path: Path) -> None:
    args = ["--log-dir", str(tmp_path), "--tee", "stdout", "--local-ranks-filter", "0", str(WORKER), "print"]
    done = multigpu_launch("--strategy", "ddp", "--nproc-per-node", "2", *args, timeout_s=150)
    assert done.returncode == 0, done.stderr[-3000:]
    (attempt,) = tmp_path.glob("*/attempt_0")
    for rank in (0, 1):  # torchrun's layout: one folder per local rank
        assert f"stdout of rank {rank}" in (attempt / str(rank) / "stdout.log").read_text()
        assert f"stderr of rank {rank}" in (attempt / str(rank) / "stderr.log").read_text()
    assert "stdout of rank 0" in done.stdout and "stdout of rank 1" not in done.stdout  # --local-ranks-filter 0
    assert "stderr of rank" not in done.stderr  # --tee stdout: stderr only in the files
