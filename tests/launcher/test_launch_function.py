"""``multigpu.launch_function``: a function from a script read on stdin (it has no file, as a notebook cell
has none) runs on two forked ranks forming one world, twice in one interpreter; an exception on one
rank is raised in the caller with that rank's traceback; no process is left, checked by PID."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from multigpu.errors import ConfigError, LaunchError, LaunchTimeoutError, ResultError
from multigpu.launcher.function import launch_function
from multigpu.runtime.worker_env import WorkerEnv
from tests.launching import alive, fork_sleeper, run_python_stdin, start_joined_child

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
    with pytest.raises(ConfigError, match=r"strategy='zero3': .* for ddp, fsdp; for single or dp call"):
        launch_function(print, strategy="zero3")


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


def _raises_on_rank_1_and_cleans_up_slowly() -> None:
    import os
    import time

    from multigpu.session import Session

    try:
        with Session(strategy="ddp", timeout_s=60) as session:
            if session.global_rank == 1:
                raise ValueError("rank one broke on purpose")
            session.barrier()  # rank 0: a PeerExitedError as soon as rank 1's group closes
    finally:
        if os.environ["RANK"] == "1":
            time.sleep(1.0)  # its own cleanup, after its group closed: rank 0's consequence is in first


@pytest.mark.multiprocess
def test_the_rank_that_raised_is_named_not_the_one_that_lost_it_first() -> None:
    # the caller named the first record it found: rank 0's PeerExitedError, whenever the failing rank took
    # longer than its peer to get from closing its group to the end of the function
    with pytest.raises(LaunchError, match=r"^rank 1 of 2 raised ValueError: rank one broke on purpose"):
        launch_function(_raises_on_rank_1_and_cleans_up_slowly, nproc_per_node=2, timeout=60)


_ASYNC_SCRIPT = """
import os
import torch
import multigpu

def save_and_return(folder):
    model = torch.nn.Linear(4096, 4096)  # 64 MiB: the write outlasts the return by far
    checkpointer = multigpu.Checkpointer(folder=f"{{folder}}/rank{{os.environ['RANK']}}", async_save=True)
    checkpointer.save(step=1, model=model)  # no wait() or close(): the rank's end must not cut the write short
    return "returned"

print(multigpu.launch_function(save_and_return, args=({folder!r},), nproc_per_node=2))
"""


@pytest.mark.multiprocess
def test_an_async_save_left_pending_is_on_disk_when_the_call_returns(tmp_path: Path) -> None:
    # in a fresh interpreter, as from a notebook: a pytest worker that already ran OpenMP work would hand its
    # forked ranks a thread pool that hangs them (GNU OpenMP is not fork-safe), which is not what is tested here
    import multigpu

    done = run_python_stdin(_ASYNC_SCRIPT.format(folder=str(tmp_path)), timeout_s=150)
    assert done.returncode == 0 and done.stdout.strip().endswith("returned"), done.stderr[-3000:]
    # The main process writes (rank 0); the caller stops a rank once its record is in: the write came first
    steps = multigpu.Checkpointer(folder=tmp_path / "rank0").steps()
    assert steps == [1], f"rank 0's pending write was cut short: {sorted(os.listdir(tmp_path / 'rank0'))}"


def _children_of(pid: int) -> list[int]:
    """The running processes whose parent is ``pid`` (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def _fork_helpers_then(pids: str, end: str) -> None:
    """Fork two helpers that outlive the rank (one in the rank's process group, one in a group of its own,
    both holding every descriptor the rank holds), record their pids, then ``end`` the rank."""
    import os
    import signal
    import time

    helpers = [fork_sleeper(own_group=False), fork_sleeper(own_group=True)]
    with open(pids, "a") as f:
        f.write(f"{os.getpid()} {' '.join(map(str, helpers))}\n")
    if os.environ["RANK"] == "1":
        if end == "die":
            os._exit(3)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the timeout's SIGTERM is ignored: SIGKILL after the grace
        time.sleep(300)


def _recorded(path: Path) -> list[int]:
    return [int(pid) for line in path.read_text().split("\n") for pid in line.split()]


@pytest.mark.multiprocess
@pytest.mark.timeout(90)  # before the fix it waited for the helpers' end-of-file: 300 s
def test_a_rank_that_forked_helpers_and_died_is_named_and_nothing_is_left(tmp_path: Path) -> None:
    import os
    import time

    before = set(_children_of(os.getpid()))
    pids = tmp_path / "pids.txt"
    began = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 of 2 exited with code 3 before returning"):
        launch_function(_fork_helpers_then, args=(str(pids), "die"), nproc_per_node=2)
    assert time.monotonic() - began < 60
    recorded = _recorded(pids)
    assert len(recorded) == 2 * 3  # two ranks, two helpers each
    assert alive(recorded) == []
    assert set(_children_of(os.getpid())) <= before


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_rank_that_never_returns_is_stopped_at_the_timeout_and_named(tmp_path: Path) -> None:
    import os
    import time

    before = set(_children_of(os.getpid()))
    pids = tmp_path / "pids.txt"
    began = time.monotonic()
    with pytest.raises(LaunchTimeoutError, match=r"timeout=3 s passed with rank\(s\) \[1\] of 2 still running"):
        launch_function(_fork_helpers_then, args=(str(pids), "hang"), nproc_per_node=2, timeout=3)
    took = time.monotonic() - began
    assert 3 <= took < 3 + 5 + 30  # the timeout, the grace a rank ignoring SIGTERM gets, a loaded machine
    assert alive(_recorded(pids)) == []
    assert set(_children_of(os.getpid())) <= before


def _returns_then_waits_for_a_child_on_the_way_out(pids: str) -> int:
    import os

    helper = start_joined_child()  # the rank's exit joins it after fn returned
    with open(pids, "a") as f:
        f.write(f"{os.getpid()} {helper}\n")
    return int(os.environ["RANK"]) + 41


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_rank_whose_exit_hangs_after_it_returned_does_not_hang_the_caller(tmp_path: Path) -> None:
    import os

    before = set(_children_of(os.getpid()))
    pids = tmp_path / "pids.txt"
    assert launch_function(_returns_then_waits_for_a_child_on_the_way_out, args=(str(pids),), nproc_per_node=2) == 41
    assert len(_recorded(pids)) == 2 * 2
    assert alive(_recorded(pids)) == []
    assert set(_children_of(os.getpid())) <= before


def _returns_a_class_only_the_rank_can_import(folder: str) -> object:
    import sys

    sys.path.insert(0, folder)
    import rank_only_module  # type: ignore[import-not-found]

    return rank_only_module.Thing()


def _returns_a_local_class() -> object:
    class Local:
        pass

    return Local()


@pytest.mark.multiprocess
def test_a_result_that_cannot_travel_names_the_rank_the_type_and_the_fix(tmp_path: Path) -> None:
    (tmp_path / "rank_only_module.py").write_text("class Thing:\n    pass\n")
    with pytest.raises(
        ResultError,
        match=r"rank 0 returned a rank_only_module.Thing, which this process cannot unpickle "
        r"\(ModuleNotFoundError: .*\); return plain data .* or define its class at the top level of a module",
    ):
        launch_function(_returns_a_class_only_the_rank_can_import, args=(str(tmp_path),), nproc_per_node=2)
    with pytest.raises(
        ResultError, match=r"rank 0 returned a .*_returns_a_local_class.<locals>.Local that does not pickle"
    ):
        launch_function(_returns_a_local_class, nproc_per_node=2)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            {"nproc_per_node": 10_000},
            r"nproc_per_node=10000: more processes than this node runs \(at most \d+: 4 per CPU core",
        ),
        ({"nproc_per_node": True}, r"nproc_per_node=True: pass a process count >= 1"),
        ({"strategy": ["ddp"]}, r"strategy=\['ddp'\]: launch_function starts one process per device"),
        (
            {"env": {"WORLD_SIZE": "4"}},
            r"env sets WORLD_SIZE='4', which launch_function sets itself .* nproc_per_node=",
        ),
        ({"env": {"MASTER_PORT": "1", "RANK": "0"}}, r"env sets MASTER_PORT='1', RANK='0'"),
        ({"env": {"MULTIGPU_STRATEGY": "fsdp"}}, r"env sets MULTIGPU_STRATEGY='fsdp'.* strategy="),
        ({"env": {"NCCL_DEBUG": 1}}, r"env\['NCCL_DEBUG'\]=1: variable values are strings"),
        ({"env": {"A=B": "1"}}, r"env key 'A=B' is not a variable name"),
        ({"env": ["X"]}, r"env=\['X'\]: pass a dict"),
        ({"args": "abc"}, r"args='abc': pass the positional arguments as a tuple or list"),
        ({"args": 0.1}, r"args=0.1: pass the positional arguments as a tuple or list, e.g. args=\(0.1,\)"),
        ({"kwargs": {1: 2}}, r"kwargs=\{1: 2\}: pass a dict of argument names"),
        ({"timeout": 0}, r"timeout=0: pass the seconds the call may take, a finite number > 0"),
        ({"timeout": -5.0}, r"timeout=-5.0: pass the seconds"),
        ({"timeout": float("nan")}, r"timeout=nan: pass the seconds"),
        ({"timeout": float("inf")}, r"timeout=inf: .* or None for no limit"),
        ({"timeout": "60"}, r"timeout='60': pass the seconds"),
        ({"timeout": True}, r"timeout=True: pass the seconds"),
    ],
)
def test_bad_inputs_are_refused_by_name_before_any_fork(call: dict[str, object], message: str) -> None:
    import os

    before = set(_children_of(os.getpid()))
    with pytest.raises(ConfigError, match=message):
        launch_function(print, **call)  # type: ignore[arg-type]
    assert set(_children_of(os.getpid())) <= before


def test_a_function_that_is_not_callable_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"fn=42 is not callable; pass the function itself"):
        launch_function(42)  # type: ignore[arg-type]


_FSDP_SCRIPT = """
import ctypes, json, os, warnings
os.environ.pop("GLIBC_TUNABLES", None)  # started as a user's notebook is: without fsdp's malloc settings
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.update(MULTIGPU_DEBUG="1", MULTIGPU_FAILURE_DIR="/tmp/outer-run", MULTIGPU_STRATEGY="ddp",
                  MULTIGPU_RUN_ID="outer-run")  # a notebook a launch started
import torch
import multigpu
from multigpu.session import Session

class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

def mmapped_again():
    # glibc raises its mmap threshold when a mapped block is freed, unless the threshold was fixed (fsdp's
    # setting): then a second block of the same size is mapped again instead of coming from the heap. The
    # block's own chunk header says so (IS_MMAPPED, bit 1 of the size word before it): a count of mapped
    # blocks would also move with what the rank's other threads map and free meanwhile. The block is larger
    # than all the heap holds free (mallinfo2's fordblks), so no free chunk the run left behind can serve it
    # (a 1 MiB one did, now and then), and below the 32 MiB a raised threshold stops at
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = _Mallinfo2
    size = libc.mallinfo2().fordblks + (1 << 20)
    assert size < 30 << 20, size
    libc.free(libc.malloc(size))
    block = libc.malloc(size)
    again = bool(ctypes.c_size_t.from_address(block - ctypes.sizeof(ctypes.c_size_t)).value & 2)
    libc.free(block)
    return again

def train():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Session(strategy="auto") as session:
            session.setup_model(torch.nn.Linear(4, 4))
            threads, strategy = torch.get_num_threads(), session.strategy_name
    told = {{k: v for k, v in os.environ.items() if k.startswith("MULTIGPU_") and k != "MULTIGPU_CACHE_DIR"}}
    return {{"strategy": strategy, "told": told,
            "warnings": [str(w.message) for w in caught], "mmapped_again": mmapped_again(), "threads": threads}}

torch.set_num_threads(3)  # the caller's pool, sized before the fork
print(json.dumps(multigpu.launch_function(train, nproc_per_node=2, strategy="fsdp", timeout=120)))
"""


@pytest.mark.multiprocess
def test_fsdp_from_a_notebook_gets_what_multigpu_launch_gives_its_workers() -> None:
    """launch_function builds its ranks' environment as multigpu launch does, the strategy's own settings
    included, and a forked rank applies them: fsdp does not warn about missing malloc settings, the malloc
    threshold is really fixed, and the ranks share the cores instead of each keeping the caller's pool."""
    import platform

    done = run_python_stdin(_FSDP_SCRIPT.format(), timeout_s=150)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not [w for w in result["warnings"] if "GLIBC_TUNABLES" in w], result["warnings"]
    assert result["strategy"] == "fsdp", result
    token = result["told"].pop("MULTIGPU_RUN_ID")  # this launch's own: its trackers' run is not the outer one's
    assert token != "outer-run" and WorkerEnv.from_environ({"MULTIGPU_RUN_ID": token}).run_token == token
    assert result["told"] == {"MULTIGPU_STRATEGY": "fsdp"}, result  # not the outer launch's settings
    assert result["threads"] == 1, result  # OMP_NUM_THREADS=1 in the caller: 1 per rank, not the caller's 3
    if platform.libc_ver()[0] == "glibc":
        assert result["mmapped_again"] is True, result
