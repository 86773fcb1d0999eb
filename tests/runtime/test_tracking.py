"""The worker's ledger of collectives and its stacks on request, and what the launcher reads from them.

In-process: the ledger file a worker writes and the launcher reads, a real faulthandler dump on the
stack signal, the comparison of ranks' ledgers (who never arrived, who diverged), the backend's abort
text, DDP's unused parameters by name, and the log and debug options. The multi-process cases are in
tests/launcher/test_forensics.py.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from multigpu.cli import launch as launch_cli
from multigpu.devices import accelerator_type
from multigpu.errors import ConfigError
from multigpu.launcher.evidence import Evidence, main_thread_stack
from multigpu.launcher.launch import LaunchConfig, worker_env
from multigpu.launcher.torchrun import build_torchrun_args, log_args
from multigpu.runtime import collectives, tracking, world
from multigpu.session import SessionConfig
from multigpu.strategies.unused_parameters import unused_parameter_names
from tests.runtime.launched_rank import launched_as


@pytest.fixture
def launched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This process as rank 1 of 2 under ``multigpu launch`` (its failure folder), with a fresh ledger."""
    yield from launched_as(1, tmp_path, monkeypatch)


def test_each_collective_is_counted_named_and_placed_in_the_ledger_file(launched: Path) -> None:
    with collectives.issuing("barrier"):
        pass
    with collectives.issuing("reduce (mean)", [torch.zeros(3)]):
        line = sys._getframe().f_lineno - 1
    (entry,) = tracking.read_ledgers(launched, attempt=0).values()
    assert (entry.rank, entry.pid, entry.seq, entry.operation) == (1, os.getpid(), 2, "reduce (mean)")
    assert entry.site == f"test_tracking.py:{line}"  # the caller's line, not multigpu's
    assert entry.main_thread == __import__("threading").main_thread().ident


def test_outside_a_launch_the_ledger_only_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MULTIGPU_FAILURE_DIR", raising=False)
    monkeypatch.setattr(tracking, "_ledger", tracking._Ledger())
    tracking.enter("barrier")
    assert tracking._ledger.seq == 1 and tracking._ledger._map is None


def test_the_stack_signal_writes_the_main_thread_s_stack_where_the_launcher_reads_it(launched: Path) -> None:
    tracking.setup_worker()
    tracking.enter("reduce (mean)")

    def waiting_somewhere() -> None:
        os.kill(os.getpid(), tracking.STACK_SIGNAL)  # as a peer whose collective timed out sends it

    waiting_somewhere()
    entry = tracking.read_ledgers(launched, attempt=0)[1]
    frames = main_thread_stack(tracking.read_stack(launched, attempt=0, rank=1), entry)
    assert [f.function for f in frames[-2:]] == [
        "test_the_stack_signal_writes_the_main_thread_s_stack_where_the_launcher_reads_it",
        "waiting_somewhere",
    ]
    assert frames[-1].is_user and str(frames[-1]).startswith("test_tracking.py:")


def test_a_rank_stuck_before_its_first_collective_is_in_the_ledgers_and_named(launched: Path) -> None:
    tracking.setup_worker()  # rank 1 of the fixture, which never enters a collective
    behind = tracking.read_ledgers(launched, attempt=0)[1]
    assert behind.seq == 0 and behind.pid == os.getpid()  # known, so its stack can be asked for
    hang = Evidence(ledgers={0: _entry(0, 1), 1: behind}).hang([0])
    assert hang is not None and hang.missing == [1]
    assert "it had entered no collective yet" in "\n".join(hang.details())


def test_long_operation_names_still_leave_a_readable_ledger(launched: Path) -> None:
    tracking.setup_worker()
    tracking.enter("x" * 5000)
    assert tracking.read_ledgers(launched, attempt=0)[1].seq == 1


def _entry(rank: int, seq: int, operation: str = "reduce (mean)", site: str = "train.py:41") -> tracking.Entry:
    return tracking.Entry(rank=rank, pid=100 + rank, main_thread=7, seq=seq, operation=operation, site=site, since=0.0)


def test_the_ranks_behind_the_waiting_ones_are_the_ones_that_never_arrived() -> None:
    found = Evidence(ledgers={0: _entry(0, 5), 1: _entry(1, 4, site="train.py:30"), 2: _entry(2, 5), 3: _entry(3, 5)})
    hang = found.hang([0, 2])
    assert hang is not None and hang.missing == [1] and sorted(hang.waiting) == [0, 2]
    lead = hang.lead("train.py", 0)
    assert lead.startswith("multigpu launch: train.py hung: rank 1 never reached collective #5, reduce (mean) at ")
    assert "which ranks 0, 2 waited in from" in lead
    assert "its last collective was #4, reduce (mean) at train.py:30" in "\n".join(hang.details())
    assert Evidence(ledgers={0: _entry(0, 5), 1: _entry(1, 5)}).hang([0]) is None  # nobody behind: no guess


def test_ranks_waiting_in_different_operations_at_one_count_have_diverged() -> None:
    found = Evidence(ledgers={0: _entry(0, 2), 1: _entry(1, 2, "barrier", "train.py:44")})
    assert found.diverged([0, 1]) == found.ledgers
    assert Evidence(ledgers={0: _entry(0, 2), 1: _entry(1, 2)}).diverged([0, 1]) is None


def test_a_divergence_is_read_from_the_ledgers_when_only_one_rank_timed_out() -> None:
    # the first rank to time out exits, and the launcher stops the other (SIGTERM) before its own timeout
    # fires, or it loses its peer first: its ledger still shows the other collective it waited in
    found = Evidence(ledgers={0: _entry(0, 2), 1: _entry(1, 2, "barrier", "train.py:44"), 2: _entry(2, 2)})
    assert found.diverged([0]) == found.ledgers
    assert found.diverged([1]) == found.ledgers
    assert found.diverged([]) is None  # nothing timed out: no hang to explain
    assert Evidence(ledgers={0: _entry(0, 2), 1: _entry(1, 2)}).diverged([1]) is None  # the same call: no divergence


def test_the_backend_s_abort_text_and_the_failing_line_are_kept() -> None:
    stderr = (
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
        "  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 16 vs 8. Received data size "
        "doesn't match expected size. Is there a distributed collective mismatch in your code?\n"
        "Fatal Python error: Aborted\n\n"
        "Thread 0x00007febb1491b80 (most recent call first):\n"
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3245 in all_reduce\n'
        '  File "/src/multigpu/runtime/collectives.py", line 48 in reduce_value\n'
        '  File "/home/me/train.py", line 7 in <module>\n'
        '  File "<frozen runpy>", line 88 in _run_code\n\n'
    )
    said = Evidence(stderr={0: stderr}).abort_text(0, 0)
    assert Evidence(stderr_local={0: stderr}).abort_text(3, 0) == said  # from torchrun's log file of local rank 0
    assert said[0] == "terminate called after throwing an instance of 'gloo::EnforceNotMet'"
    assert said[1].endswith("Is there a distributed collective mismatch in your code?")
    assert said[-1] == "Python was at train.py:7 in <module>"
    assert Evidence(stderr={0: "an ordinary warning\n"}).abort_text(0, 0) == []


def test_unused_parameters_are_named_as_ddp_counts_them() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Linear(2, 2).requires_grad_(False)  # DDP does not count it
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)
            self.tied = self.a  # shared: counted once, under its first name
            self.c = nn.Linear(2, 2, bias=False)

    message = "... Parameter indices which did not receive grad for rank 1: 2 3 4\n In addition, you can set ..."
    assert unused_parameter_names(Net(), message, ignored=set()) == [
        "b.weight (in b: Linear)",
        "b.bias (in b: Linear)",
        "c.weight (in c: Linear)",
    ]
    # ignored parameters are left out of DDP's count
    assert unused_parameter_names(Net(), message, ignored={"a.weight"})[0] == "b.bias (in b: Linear)"
    assert unused_parameter_names(Net(), "no indices here", ignored=set()) == []
    # under TORCH_DISTRIBUTED_DEBUG=INFO torch names them itself: their modules are added
    info = "Parameters which did not receive grad for rank 0: c.weight, b.bias\nParameter indices which did not ..."
    assert unused_parameter_names(Net(), info, ignored=set()) == ["b.bias (in b: Linear)", "c.weight (in c: Linear)"]


def test_log_options_map_to_torchrun_s_own() -> None:
    assert log_args(LaunchConfig(log_dir="/mine"), "/mine") == ["--log-dir", "/mine", "--redirects", "3", "--tee", "3"]
    filtered = log_args(LaunchConfig(log_dir="/l", tee="stdout", local_ranks_filter=(0, 2)), "/l")
    assert filtered == ["--log-dir", "/l", "--redirects", "3", "--tee", "1", "--local-ranks-filter", "0,2"]
    config = LaunchConfig(nproc_per_node=2, log_dir="/l")
    args = build_torchrun_args(config, "t.py", ["--log-dir", "x"], log_dir="/l")
    assert args[args.index("--module") - 6 : args.index("--module")] == log_args(config, "/l")
    # without log options torchrun writes no files: the console stays as torchrun's, and each worker
    # copies its own stderr for the summary instead
    assert "--log-dir" not in build_torchrun_args(LaunchConfig(nproc_per_node=2), "t.py", [])
    assert worker_env(LaunchConfig(strategy="ddp"), "ddp", 2)["MULTIGPU_STDERR_COPY"] == "1"
    assert "MULTIGPU_STDERR_COPY" not in worker_env(config, "ddp", 2)


def test_bad_log_options_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tee='all' is not one of \['both', 'none', 'stderr', 'stdout'\]"):
        LaunchConfig(tee="all")
    with pytest.raises(ConfigError, match=r"local_ranks_filter=\(-1,\) must name local ranks >= 0"):
        LaunchConfig(local_ranks_filter=(-1,))
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"is a file; pass a folder"):
        LaunchConfig(log_dir=str(tmp_path / "file"))


def test_the_cli_reads_torchrun_s_spellings(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    launch_cli.add_arguments(parser)
    config = launch_cli.config_from_args(parser.parse_args(["--tee", "3", "--local-ranks-filter", "0,1", "t.py"]))
    assert (config.tee, config.local_ranks_filter, config.debug) == ("both", (0, 1), False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--local-ranks-filter", "a", "t.py"])
    assert "'a' is not a list of local ranks; pass e.g. 0 or 0,1" in capsys.readouterr().err


def test_debug_is_one_variable_for_the_workers_and_torch_s_checks_in_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert worker_env(LaunchConfig(strategy="ddp", debug=True), "ddp", 2)["MULTIGPU_DEBUG"] == "1"
    assert "MULTIGPU_DEBUG" not in worker_env(LaunchConfig(strategy="ddp"), "ddp", 2)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "OFF")
    monkeypatch.setattr(tracking, "_ledger", tracking._Ledger())
    monkeypatch.setattr(world, "_torch_debug", False)  # restored after: later groups are not debugged
    try:
        tracking.enable_debug()
        # DETAIL under NCCL; INFO under gloo, whose DDP torch 2.13's CPU build crashes under DETAIL
        level = "DETAIL" if accelerator_type() == "cuda" else "INFO"
        assert tracking.debug_enabled() and os.environ["TORCH_DISTRIBUTED_DEBUG"] == level
        assert dist.get_debug_level() == getattr(dist.DebugLevel, level)
    finally:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "OFF"
        dist.set_debug_level_from_env()
    with pytest.raises(ConfigError, match=r"debug='yes' must be True or False"):
        SessionConfig(debug="yes")  # type: ignore[arg-type]
    assert world.debug_requested() is False


def test_debug_level_follows_the_backend_the_group_uses_not_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU machine whose ranks train on the CPU (``devices="cpu"``) builds a gloo group: INFO there, not
    DETAIL (torch 2.13's CPU build crashes building DDP over a DETAIL-wrapped gloo group)."""
    from multigpu.devices import get_device_type
    from multigpu.runtime.world import LaunchEnv
    from tests.conftest import free_port

    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "OFF")
    monkeypatch.setattr(get_device_type("cuda"), "is_available", lambda: True)  # a GPU machine, as the registry sees it
    monkeypatch.setattr(tracking, "_ledger", tracking._Ledger())
    monkeypatch.setattr(world, "_torch_debug", False)  # restored after the test: later groups are not debugged
    env = LaunchEnv(
        global_rank=0, local_rank=0, world_size=1, local_world_size=1, master_addr="127.0.0.1", master_port=free_port()
    )
    try:
        tracking.enable_debug()
        assert os.environ["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"  # the machine's workers would use nccl
        world.setup_process_group(env, torch.device("cpu"), timeout_s=30)  # but this rank's group is gloo
        assert dist.get_backend() == "gloo" and os.environ["TORCH_DISTRIBUTED_DEBUG"] == "INFO"
        assert dist.get_debug_level() == dist.DebugLevel.INFO
    finally:
        world.teardown_process_group()
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "OFF"
        dist.set_debug_level_from_env()
    assert [world.torch_debug_level(b) for b in ("nccl", "gloo", "cpu:gloo,cuda:nccl")] == ["DETAIL", "INFO", "INFO"]


def test_the_summary_s_pointer_leads_to_a_section_of_the_guide() -> None:
    from multigpu.launcher.evidence import GUIDE

    path, section = GUIDE.split(", section ")
    headings = [line.lstrip("# ").strip() for line in Path(path).read_text().splitlines() if line.startswith("## ")]
    assert section.strip("'") in headings
