"""Asynchronous saves (``Checkpointer(async_save=True)``): the same checkpoint as a blocking save, written behind.

The oracle is a blocking save of the same state: resuming either gives bit-identical model,
optimizer, scheduler, random and counter state, even though the caller changed everything right
after the asynchronous save returned. Failures of the background write surface as CheckpointError
at the next save, wait or close (on every rank under ddp), and a write that fails or is killed
leaves the previous checkpoint whole and the latest.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sklearn.datasets  # noqa: F401 (see below)
import torch
import torch._dynamo  # see below
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor

import multigpu.checkpoint as ckpt
from multigpu.checkpoint.atomic import is_temporary
from multigpu.checkpoint.dcp import Sharded, live_state
from multigpu.checkpoint.ranks import Staging
from multigpu.errors import CheckpointError, ConfigError
from tests.checkpoint import _sharded as sh
from tests.launching import launch_workers, multigpu_launch, start_python

WORKER = Path(__file__).parent / "workers" / "async_saves.py"

# scikit-learn (the digits) and torch._dynamo (fully_shard's first call) set environment variables
# when first imported: imported with this module, not inside a test, whose guard (tests/conftest.py)
# would take them for the test's own changes.


class Tied(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
        self.norm = nn.BatchNorm1d(width)  # buffers, an int64 counter among them
        self.head = nn.Linear(width, width, bias=False)
        self.head.weight = self.body[0].weight  # tied: written once, shared again on resume

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))


def _build(width: int, depth: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = Tied(width, depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, steps: int, width: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, width)).square().mean().backward()
        optimizer.step()
        scheduler.step()


def _everything(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> list[Any]:
    return [model.state_dict(), optimizer.state_dict(), scheduler.state_dict(), torch.get_rng_state(), random.random()]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _resumed(folder: Path, width: int, depth: int) -> tuple[list[Any], ckpt.Resumed]:
    model, optimizer, scheduler = _build(width, depth, seed=99)
    resumed = ckpt.Checkpointer(folder=folder).resume(model=model, optimizer=optimizer, scheduler=scheduler)
    assert resumed is not None
    assert model.head.weight is model.body[0].weight
    return _everything(model, optimizer, scheduler), resumed


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(width=st.sampled_from([3, 16, 64]), depth=st.integers(1, 3), steps=st.integers(0, 4))
def test_an_async_save_resumes_bit_identical_to_a_blocking_one(
    tmp_path: Path, width: int, depth: int, steps: int
) -> None:
    case = tmp_path / f"{width}-{depth}-{steps}-{time.monotonic_ns()}"
    model, optimizer, scheduler = _build(width, depth, seed=width + depth)
    _train(model, optimizer, scheduler, steps, width)
    position = {"batch": steps, "shard": "a"}
    extra = {"losses": torch.arange(float(steps + 1)), "note": [1, 2.5, "x"]}

    state = torch.get_rng_state()
    ckpt.Checkpointer(folder=case / "sync").save(
        step=steps, model=model, optimizer=optimizer, scheduler=scheduler, data_position=position, extra=extra
    )
    torch.set_rng_state(state)
    asynchronous = ckpt.Checkpointer(folder=case / "async", async_save=True)
    asynchronous.save(
        step=steps, model=model, optimizer=optimizer, scheduler=scheduler, data_position=position, extra=extra
    )
    # The snapshot was taken before save returned: everything may change at once.
    _train(model, optimizer, scheduler, 2, width)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    extra["losses"].add_(7.0)
    position["batch"] = -1
    asynchronous.wait()

    expected, by_sync = _resumed(case / "sync", width, depth)
    found, by_async = _resumed(case / "async", width, depth)
    assert _same(expected, found)
    assert (by_async.step, by_async.data_position, by_async.extra["note"]) == (
        steps,
        {"batch": steps, "shard": "a"},
        [1, 2.5, "x"],
    )
    assert torch.equal(by_async.extra["losses"], by_sync.extra["losses"])


def test_save_returns_before_the_write_and_wait_puts_it_on_disk(tmp_path: Path) -> None:
    with ckpt.Checkpointer(folder=tmp_path, async_save=True, keep_last=2) as checkpointer:
        model = nn.Linear(64, 64)
        for step in (1, 2, 3):
            checkpointer.save(step=step, model=model)  # each save waits for the previous write
        checkpointer.wait()
        assert checkpointer.steps() == [2, 3]
        checkpointer.save(step=4, model=model)
    assert checkpointer.steps() == [3, 4]  # leaving the with block waited
    assert not [p for p in tmp_path.iterdir() if is_temporary(p)]


def test_async_save_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"async_save='yes' must be True or False"):
        ckpt.Checkpointer(folder=tmp_path, async_save="yes")  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore:ignoring 1 entries")
def test_resume_waits_for_a_failed_write_and_the_next_wait_raises_it(tmp_path: Path) -> None:
    checkpointer = ckpt.Checkpointer(folder=tmp_path, async_save=True)
    model = nn.Linear(8, 8)
    checkpointer.save(step=1, model=model)
    checkpointer.wait()
    (tmp_path / "step-00000002").write_text("not a checkpoint")  # the write of step 2 must refuse it
    with torch.no_grad():
        model.weight.add_(1.0)
    checkpointer.save(step=2, model=model)
    again = nn.Linear(8, 8)
    resumed = checkpointer.resume(model=again)  # waited for the write: step 1 is still the latest
    assert resumed is not None and resumed.step == 1 and not torch.equal(again.weight, model.weight)
    with pytest.raises(CheckpointError, match="step-00000002"):
        checkpointer.wait()
    checkpointer.wait()  # raised once: nothing pending now
    assert checkpointer.latest() == tmp_path / "step-00000001"


@pytest.mark.filterwarnings("ignore:ignoring 1 entries")
def test_a_failure_of_a_dropped_checkpointer_is_printed(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "step-00000001").write_text("not a checkpoint")  # the write of step 1 must refuse it
    checkpointer = ckpt.Checkpointer(folder=tmp_path, async_save=True)
    checkpointer.save(step=1, model=nn.Linear(8, 8))
    for thread in threading.enumerate():
        if thread.name.startswith("multigpu-checkpoint-"):
            thread.join(timeout=60)
    del checkpointer
    gc.collect()
    err = capfd.readouterr().err
    assert "multigpu: " in err and "step-00000001" in err, err


def _communicate(child: Any, timeout: float = 120) -> tuple[str, str]:
    try:
        return child.communicate(timeout=timeout)  # type: ignore[no-any-return]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)


@pytest.mark.multiprocess
def test_a_file_size_limit_in_the_background_is_raised_at_the_next_wait_save_and_close(tmp_path: Path) -> None:
    child = start_python(str(WORKER), "size-limit", str(tmp_path), str(2 << 20))
    out, err = _communicate(child)
    assert child.returncode == 0, err
    lines = [line for line in out.strip().splitlines() if line != "returned"]
    assert out.count("returned") == 3 and [line.split(":")[0] for line in lines] == ["wait", "save", "close"], out
    for line in lines:
        assert "step-00000002" in line and "a file-size limit was hit, not a full disk" in line, line
        assert "RLIMIT_FSIZE" in line and "is full" not in line
    assert "multigpu:" not in err  # every failure was collected; none left for the exit report
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    assert checkpointer.latest() == tmp_path / "step-00000001" and checkpointer.steps() == [1]
    small = nn.Linear(512, 512)
    assert checkpointer.resume(model=small) is not None and bool((small.weight == 1.0).all())


@pytest.mark.multiprocess
def test_sigkill_during_a_background_write_leaves_the_previous_step_as_latest(tmp_path: Path) -> None:
    child = start_python(str(WORKER), "killed", str(tmp_path))
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "saved 1"
        assert child.stdout.readline().strip() == "returned 2"
        deadline = time.monotonic() + 30
        while not [p for p in tmp_path.iterdir() if is_temporary(p)]:
            assert time.monotonic() < deadline, "the background write never started"
            time.sleep(0.001)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    if checkpointer.latest() != tmp_path / "step-00000001":  # the write finished before the kill landed
        pytest.fail("the kill landed after the write; the 64 MiB write must take longer than the poll")
    model = nn.Linear(4096, 4096)
    resumed = checkpointer.resume(model=model)
    assert resumed is not None and resumed.step == 1 and bool((model.weight == 1.0).all())


@pytest.mark.multiprocess
def test_the_process_waits_for_a_pending_write_before_it_exits(tmp_path: Path) -> None:
    # As after a pre-emption stop: save, leave the loop, end the script without wait().
    child = start_python(str(WORKER), "exit", str(tmp_path))
    out, err = _communicate(child)
    assert child.returncode == 0 and out.strip() == "returned", err
    model = nn.Linear(2048, 2048)
    resumed = ckpt.Checkpointer(folder=tmp_path).resume(model=model)
    assert resumed is not None and resumed.step == 1 and bool((model.weight == 1.0).all())


@pytest.mark.multiprocess
def test_a_failed_write_on_rank_0_is_raised_on_every_rank(tmp_path: Path) -> None:
    done = launch_workers(WORKER, "ddp-failure", str(tmp_path / "ckpt"), timeout_s=180)
    output = done.stdout + done.stderr
    for rank in (0, 1):
        line = next((x for x in output.splitlines() if f"rank {rank} wait:" in x), "")
        assert "step-00000002" in line and "file-size limit" in line, output[-3000:]
    assert "rank 0 failed writing the last checkpoint in the background" in output
    assert ckpt.Checkpointer(folder=tmp_path / "ckpt").steps() == [3, 4]
    for rank in (0, 1):  # every rank's resume waited for rank 0's write of step 4
        assert f"rank {rank} resumed: 4 4.0" in output, output[-3000:]


def test_staging_keeps_views_and_values_and_reuses_its_buffers() -> None:
    staging = Staging()
    base = torch.arange(12.0).reshape(3, 4)
    state = {
        "t": base.t(),  # a transposed view and a row of the same storage: one buffer, both views
        "row": base[1],
        "conj": torch.randn(3, dtype=torch.complex64).conj(),  # a lazy conjugate keeps its value
        "empty": torch.empty(0),
        "nested": [{"step": torch.tensor(5)}, ("a", 2)],
    }
    copied = staging.copy(state)
    assert _same(state, copied)
    assert copied["t"].untyped_storage().data_ptr() == copied["row"].untyped_storage().data_ptr()
    base.add_(1.0)
    assert torch.equal(copied["row"], base[1] - 1.0)  # a copy, not the live tensor
    again = staging.copy(state)
    assert again["t"].untyped_storage().data_ptr() == copied["t"].untyped_storage().data_ptr()  # reused
    assert torch.equal(again["row"], base[1])


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_under_fsdp_save_returns_before_the_shards_are_written_and_resumes_bit_identical(
    one_rank: None, tmp_path: Path
) -> None:
    run = sh.build_run(sh.sharded_model())
    parts = lambda r: sh.local([r.model.state_dict(), r.optimizer.state_dict(), r.scheduler.state_dict()])  # noqa: E731
    saved = {0: parts(run)}  # step 0: an optimizer that has not stepped (its param groups go into state.pt)
    with ckpt.Checkpointer(folder=tmp_path, async_save=True, keep_last=None) as checkpointer:
        for step in (0, 1, 2):
            if step:
                saved[step] = parts(run)
            checkpointer.save(step=step, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler)
            sh.train_step(run, step)  # at once: the shards were staged
            with torch.no_grad():
                for p in run.model.parameters():
                    p.add_(1.0)
        checkpointer.wait()
        assert checkpointer.steps() == [0, 1, 2]
        for step in (0, 1, 2):
            again = sh.build_run(sh.sharded_model())
            resumed = checkpointer.resume(
                path=tmp_path / f"step-{step:08d}",
                model=again.model,
                optimizer=again.optimizer,
                scheduler=again.scheduler,
            )
            assert resumed is not None and resumed.step == step
            assert _same(saved[step], parts(again)), step
    assert (tmp_path / "step-00000002" / "manifest.json").is_file()


def test_under_fsdp_checkpointers_share_one_group_and_take_turns(one_rank: None, tmp_path: Path) -> None:
    run = sh.build_run(sh.sharded_model())
    sh.train_step(run, 0)
    groups = dist.distributed_c10d.get_pg_count()
    checkpointers = [ckpt.Checkpointer(folder=tmp_path / str(i), async_save=True) for i in range(3)]
    for i, checkpointer in enumerate(checkpointers):  # one writes while the next saves: it waits for it
        checkpointer.save(step=i + 1, model=run.model, optimizer=run.optimizer)
    assert dist.distributed_c10d.get_pg_count() == groups + 1  # not a group per Checkpointer
    for i, checkpointer in enumerate(checkpointers):
        checkpointer.close()
        assert checkpointer.steps() == [i + 1]


def test_sharded_staging_copies_into_the_same_host_memory_at_every_save(one_rank: None) -> None:
    run = sh.build_run(sh.sharded_model())
    sh.train_step(run, 0)
    staging = Staging()  # a Checkpointer's, kept between saves
    first = Sharded(run.model, run.optimizer).staged(staging)._shards
    where = {k: v.to_local().data_ptr() if isinstance(v, DTensor) else v.data_ptr() for k, v in _leaves(first)}
    sh.train_step(run, 1)
    live = live_state(run.model, run.optimizer)[0]
    second = Sharded(run.model, run.optimizer).staged(staging)._shards
    assert _same(sh.local(second), sh.local(live))  # this save's values
    assert where == {k: v.to_local().data_ptr() if isinstance(v, DTensor) else v.data_ptr() for k, v in _leaves(second)}
    assert all(
        v.to_local().data_ptr() != w.to_local().data_ptr()
        for (_, v), (_, w) in zip(_leaves(live), _leaves(second))
        if isinstance(v, DTensor)
    )


def _leaves(shards: dict[str, Any]) -> list[tuple[str, Any]]:
    return [
        (f"{part}.{k}", v) for part, values in shards.items() for k, v in values.items() if isinstance(v, torch.Tensor)
    ]


FSDP_WORKER = Path(__file__).parent / "workers" / "fsdp_async.py"


@pytest.mark.multiprocess
def test_fsdp_async_saves_round_trip_fail_on_every_rank_survive_a_kill_and_finish_at_a_stop(tmp_path: Path) -> None:
    folder, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    done = multigpu_launch(
        "--strategy", "fsdp", "--nproc-per-node", "2", "--max-restarts", "1", str(FSDP_WORKER), str(folder), str(out),
        timeout_s=240,
    )  # fmt: skip
    report = f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert done.returncode == 0, report
    # A failure in the background write (rank 1's file-size limit) is raised on both ranks by the next save,
    # and again by wait, with its real cause; step 1 stays whole and the latest.
    for rank in (0, 1):
        save, wait, steps = (out / f"failure-rank{rank}.txt").read_text().splitlines()
        for line, where in ((save, "save"), (wait, "wait")):
            assert line.startswith(f"{where}: ") and "step-00000002" in line, line
            assert "a file-size limit was hit, not a full disk" in line and "is full" not in line, line
        assert steps == f"steps: [1] latest: {folder / 'step-00000001'}", steps
    # Rank 1 was killed inside its background write of step 2, after save had returned; the restart resumed
    # step 1 on both ranks, bit for bit as it was when save was called, random states included.
    assert (out / "returned-rank1.txt").is_file()
    killed = (out / "killed.txt").read_text().split()
    assert killed[-1] == "multigpu-checkpoint-step-00000002" and ".step-00000002.tmp" in killed[1], killed
    for rank in (0, 1):
        expected = torch.load(out / f"expected-rank{rank}.pt")
        found = torch.load(out / f"resumed-rank{rank}.pt")
        assert found.pop("step") == 1
        assert _same(expected, found), rank
    # Stopped by a SIGTERM to rank 1: the last save's write (slowed) was finished before the group closed.
    stop = int((out / "stopped.txt").read_text())
    assert "multigpu: writing checkpoint" not in done.stderr, report
    checkpointer = ckpt.Checkpointer(folder=folder)
    assert checkpointer.latest() == folder / f"step-{stop:08d}" and checkpointer.steps() == [stop - 1, stop]
    assert not [p for p in folder.iterdir() if is_temporary(p)]
    whole = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    with pytest.warns(RuntimeWarning, match="resuming at world_size=1 from a checkpoint saved at world_size=2"):
        resumed = checkpointer.resume(model=whole)  # one process reads the sharded checkpoint whole: it is complete
    assert resumed is not None and resumed.step == stop and resumed.saved_world_size == 2
