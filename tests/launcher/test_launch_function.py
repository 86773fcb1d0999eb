"""``multigpu.launch_function``: a function from a script read on stdin (it has no file, as a notebook cell
has none) runs on two forked ranks forming one world, twice in one interpreter; an exception on one
rank is raised in the caller with that rank's traceback; no process is left, checked by PID."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from multigpu.errors import ConfigError
from multigpu.launcher.function import launch_function
from tests.launching import alive, run_python_stdin

_SCRIPT = """
import json, os, subprocess, sys, time
import torch
import multigpu
from multigpu.session import Session

PIDS = {pids!r}

def train(scale):
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # e.g. a loader worker
    with open(PIDS, "a") as f:
        f.write(f"{{os.getpid()}} {{helper.pid}}\\n")
    with Session(strategy="ddp", seed=0) as session:
        model = session.setup_model(torch.nn.Linear(2, 1))
        total = session.reduce(float(session.global_rank + 1) * scale, "sum")
        weight = session.unwrap(model).weight.detach().flatten().tolist()
        return [session.world_size, session.global_rank, total, weight]

def broken():
    with open(PIDS, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    with Session(strategy="ddp", timeout_s=60) as session:
        if session.global_rank == 1:
            raise ValueError("rank one broke on purpose")
        session.barrier()  # rank 0 waits here for a rank that will never come

first = multigpu.launch_function(train, args=(1.0,), nproc_per_node=2)
second = multigpu.launch_function(train, kwargs={{"scale": 10.0}}, nproc_per_node=2)
try:
    multigpu.launch_function(broken, nproc_per_node=2)
    error = None
except multigpu.LaunchError as exc:
    error = [str(exc), type(exc.__cause__).__name__]
print(json.dumps({{"first": first, "second": second, "error": error}}))
"""


@pytest.mark.multiprocess
def test_a_function_from_stdin_twice_then_an_error_and_no_process_left(tmp_path: Path) -> None:
    pids = tmp_path / "pids.txt"
    done = run_python_stdin(_SCRIPT.format(pids=str(pids)), timeout_s=150)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    torch_seed0 = report["first"][3]
    assert report["first"][:3] == [2, 0, 3.0]  # rank 0's answer; 1 + 2 summed over one world of two
    assert report["second"][:3] == [2, 0, 30.0]
    assert report["second"][3] == torch_seed0  # the same seed gives the same model in the second world
    message, cause = report["error"]
    assert message.startswith("rank 1 of 2 raised ValueError: rank one broke on purpose")
    assert 'File "<stdin>", line 24, in broken' in message  # the failing rank's traceback (stdin: no source lines)
    assert cause == "ValueError"
    recorded = [int(pid) for line in pids.read_text().split("\n") for pid in line.split()]
    assert len(recorded) == 2 * 2 + 2 * 2 + 2  # two ranks and their helpers, twice; then two ranks
    assert alive(recorded) == []


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"nproc_per_node=0: pass a process count >= 1"):
        launch_function(print, nproc_per_node=0)
    with pytest.raises(ConfigError, match=r"strategy='dp': launch_function starts one process per device"):
        launch_function(print, strategy="dp")


@pytest.mark.multiprocess
def test_the_guides_notebook_cell_works_as_written() -> None:
    guide = (Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text()
    section = guide.split("### From a notebook", 1)[1]
    cell = section.split("```python\n", 1)[1].split("```", 1)[0]
    done = run_python_stdin(cell, timeout_s=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.strip().splitlines()[-1]) >= 0.0  # the mean loss rank 0 returned


def _exits_cleanly_on_rank_1() -> object:
    import os
    import sys

    import torch

    if os.environ["RANK"] == "1":
        sys.exit(0)
    return {"weights": torch.ones(2)}


@pytest.mark.multiprocess
def test_sys_exit_0_is_a_clean_end_and_tensors_come_back_on_the_cpu() -> None:
    result = launch_function(_exits_cleanly_on_rank_1, nproc_per_node=2)
    assert result["weights"].device.type == "cpu" and result["weights"].tolist() == [1.0, 1.0]
