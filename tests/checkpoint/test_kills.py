"""Crash consistency: SIGKILL at random points of saves, then check what is on disk.

After every kill: the latest loadable checkpoint is complete (its weights and its state belong
together) and equals one that was saved, and no checkpoint that was complete before the kill is
gone. Scenarios: ``multigpu.save`` of one file, ``Checkpointer.save`` of increasing steps, a
re-save of the same step (with renameat2 exchange and with the aside fallback), and two
processes saving into one folder at once.

CI runs one kill per scenario (each costs a process start); ``MULTIGPU_KILL_CASES=40`` runs 40
each and adds the fallback re-save scenario (minutes). Each test prints its counts (``pytest -s``),
including how many kills left a temporary entry, i.e. landed in the middle of a write.

The deterministic companion, :func:`test_a_resaved_step_is_findable_at_every_rename`, checks the
folder at every rename a re-save makes, which is where a kill can land.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from torch import nn

import multigpu.checkpoint as ckpt
from multigpu.checkpoint.atomic import is_temporary
from tests.checkpoint._renames import before_every_rename
from tests.checkpoint.workers.save_forever import WIDTH
from tests.launching import start_python

WORKER = Path(__file__).parent / "workers" / "save_forever.py"
KILLS = int(os.environ.get("MULTIGPU_KILL_CASES", "1"))
LONG = "MULTIGPU_KILL_CASES" in os.environ

pytestmark = pytest.mark.timeout(120 + 30 * KILLS)


@dataclass
class Tally:
    kills: int = 0
    mid_write: int = 0  # kills after which a temporary entry was left: the kill landed inside a write
    lost: int = 0
    problems: list[str] = field(default_factory=list)

    def report(self, name: str) -> None:
        print(f"\n[kills] {name}: {self.kills} kills, {self.mid_write} mid-write, {self.lost} lost")
        assert not self.problems, self.problems[:5]


class Worker:
    def __init__(self, mode: str, folder: Path, *extra: str) -> None:
        self.process = start_python(str(WORKER), mode, str(folder), *extra)

    def first_save(self) -> int:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith("saved "):
            self.kill()
            raise AssertionError(f"the worker did not save: {line!r} {self.stderr()}")
        return int(line.split()[1])

    def kill(self) -> tuple[list[int], str]:
        """SIGKILL (no handler can run); the values it reported saved, and its stderr."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        assert self.process.stdout is not None
        saved = [int(line.split()[1]) for line in self.process.stdout.read().splitlines() if line.startswith("saved ")]
        return saved, self.stderr()

    def stderr(self) -> str:
        assert self.process.stderr is not None
        return self.process.stderr.read() if self.process.poll() is not None else ""


def _kill_points(seed: int) -> Iterator[float]:
    rng = random.Random(seed)
    for _ in range(KILLS):
        yield rng.uniform(0.0, 0.4)  # a save of 4 MiB takes tens of milliseconds here


def _value(model: nn.Module) -> float:
    weight = model.weight.detach()
    value = float(weight[0, 0])
    assert bool((weight == value).all()) and bool((model.bias.detach() == value).all()), "a mixed tensor"
    return value


def _resume(folder: Path) -> tuple[int, float, float] | None:
    """(step, weights' value, state's value) of the latest checkpoint."""
    model = nn.Linear(WIDTH, WIDTH)
    resumed = ckpt.Checkpointer(folder=folder).resume(model=model)
    if resumed is None:
        return None
    return resumed.step, _value(model), float(resumed.extra["value"])


def _leftovers(folder: Path) -> bool:
    return any(is_temporary(p) or ".prev-" in p.name for p in folder.iterdir())


def _run(tally: Tally, mode: str, folder: Path, seed: int, *extra: str) -> Iterator[tuple[list[int], int]]:
    """Start a worker, let it save, kill it at a random point; yields (saved values, first value)."""
    for delay in _kill_points(seed):
        worker = Worker(mode, folder, *extra)
        first = worker.first_save()
        time.sleep(delay)
        saved, stderr = worker.kill()
        tally.kills += 1
        tally.mid_write += _leftovers(folder)
        if "Traceback" in stderr:
            tally.problems.append(f"the worker failed before the kill: {stderr[-500:]}")
        yield [first, *saved], first


@pytest.mark.multiprocess
def test_kills_during_multigpu_save_leave_a_whole_file(tmp_path: Path) -> None:
    tally = Tally()
    for saved, _ in _run(tally, "weights", tmp_path, seed=1):
        model = nn.Linear(WIDTH, WIDTH)
        ckpt.load(model, tmp_path / "model.safetensors")
        value = _value(model)
        if value not in (saved[-1], saved[-1] + 1):  # the last reported save, or the one in flight
            tally.problems.append(f"file holds {value}, saves reported {saved[-3:]}")
    # The next save removes every temporary the kills left (this host, dead processes).
    ckpt.save(nn.Linear(2, 2), tmp_path / "model.safetensors")
    assert not [p.name for p in tmp_path.iterdir() if is_temporary(p)]
    tally.report("multigpu.save")


@pytest.mark.parametrize(
    "mode",
    [
        "steps",
        "resave",
        pytest.param("resave --fallback", marks=pytest.mark.skipif(not LONG, reason="long run only")),
    ],
)
@pytest.mark.multiprocess
def test_kills_during_checkpointer_saves_lose_nothing(tmp_path: Path, mode: str) -> None:
    name, *extra = mode.split()
    tally = Tally()
    for saved, _ in _run(tally, name, tmp_path, 2, *extra):
        found = _resume(tmp_path)
        if found is None:
            tally.lost += 1
            tally.problems.append(f"no checkpoint after saves {saved[-3:]}")
            continue
        step, weights, state = found
        if weights != state:
            tally.problems.append(f"step {step}: weights of save {weights} with the state of save {state}")
        if state not in (saved[-1], saved[-1] + 1):
            tally.lost += state < saved[-1]
            tally.problems.append(f"latest holds save {state}, saves reported {saved[-3:]}")
        if name == "steps" and saved[-1] not in ckpt.Checkpointer(folder=tmp_path).steps():
            tally.lost += 1
            tally.problems.append(f"step {saved[-1]}, reported saved, is gone")
    tally.report(f"Checkpointer.save {mode}")


@pytest.mark.multiprocess
def test_two_processes_saving_the_same_steps_both_succeed(tmp_path: Path) -> None:
    # Small saves of one step, many of them, so the two processes' renames interleave.
    writers = [Worker("resave", tmp_path, "--saves", "30", "--width", "4", "--fresh") for _ in (1, 2)]
    for writer in writers:
        writer.process.wait(timeout=120)
        assert writer.process.returncode == 0, writer.stderr()[-2000:]
    model = nn.Linear(4, 4)
    resumed = ckpt.Checkpointer(folder=tmp_path).resume(model=model)
    assert resumed is not None and resumed.step == 5 and _value(model) == resumed.extra["value"]


@pytest.mark.multiprocess
def test_two_processes_saving_into_one_folder(tmp_path: Path) -> None:
    tally = Tally()
    rng = random.Random(3)
    for i, delay in enumerate(_kill_points(4)):
        folder = tmp_path / f"run-{i}"
        writers = [Worker("concurrent", folder, "--writer", str(w)) for w in (1, 2)]
        firsts = [w.first_save() for w in writers]
        time.sleep(delay)
        reports = []
        for w in rng.sample(writers, 2):  # one dies first, the other a moment later
            reports.append(w.kill())
            time.sleep(rng.uniform(0, 0.05))
        tally.kills += 2
        tally.mid_write += _leftovers(folder)
        saved = firsts + [v for values, _ in reports for v in values]
        for _, stderr in reports:
            if "Traceback" in stderr or "Error" in stderr:
                tally.problems.append(f"a writer failed: {stderr[-500:]}")
        found = _resume(folder)
        if found is None:
            tally.lost += 1
            tally.problems.append("no checkpoint after two writers")
            continue
        step, weights, state = found
        highest = max(v % 1_000_000 for v in saved)
        if weights != state or state % 1_000_000 != step or state // 1_000_000 not in (1, 2):
            tally.problems.append(f"step {step}: weights {weights}, state {state}")
        if step < highest:
            tally.lost += 1
            tally.problems.append(f"latest step {step}, but step {highest} was reported saved")
    tally.report("two writers, one folder")


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "aside-fallback"])
def test_a_resaved_step_is_findable_at_every_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    # A kill can land between any two system calls of a save; the ones that change what a name
    # points at are renames. At each (before it runs), step 5 must be found, complete.
    try:
        from multigpu.checkpoint import atomic

        monkeypatch.setattr(atomic, "use_exchange", exchange)
    except ImportError:
        pass  # older code, without the module: the test then shows what it did
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    checkpointer.save(step=5, model=nn.Linear(3, 2))
    seen: list[Path | None] = []
    with before_every_rename(lambda: seen.append(ckpt.find_latest(tmp_path))):
        checkpointer.save(step=5, model=nn.Linear(3, 2))
    assert seen, "the re-save made no rename"
    assert all(found is not None for found in seen), seen
    assert ckpt.find_latest(tmp_path) == tmp_path / "step-00000005"
