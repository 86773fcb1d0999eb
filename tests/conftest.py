"""Shared fixtures. The oracle everywhere is plain PyTorch on one device.

Every test also runs under a guard that fails it when it leaks what the next test would trip on:
a process group left initialized, an environment variable changed, a thread still running, or
processes started without the ``multiprocess`` marker (so ``-m "not multiprocess"`` stays a fast,
in-process subset).
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, settings

from multigpu.devices import register_device_type, unregister_device_type
from tests.devices.fake_device import MetaDevice

_PROCESS_EVENTS = {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec"}
# Set by libraries for themselves on their first use in a process, whichever test that is: scikit-learn's
# import (setdefault of the two KMP_ variables) and torch's first optimizer (inductor's cache folder).
_SET_BY_LIBRARIES = {"KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK", "TORCHINDUCTOR_CACHE_DIR"}
_started = [0]  # processes started so far in this interpreter (an audit hook cannot be removed: count)


# The machine's cores are shared: how fast hypothesis generates data says nothing about the code
# (its too_slow check failed a derandomized planner property under load); no per-example deadline.
settings.register_profile("shared-cores", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("shared-cores")


def _count_process_starts(event: str, _args: object) -> None:
    if event in _PROCESS_EVENTS:
        _started[0] += 1


sys.addaudithook(_count_process_starts)


@pytest.fixture(autouse=True, scope="session")
def _planner_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The planner's machine constants (MULTIGPU_CACHE_DIR) in a folder of the session's, filled with fixed
    figures: a CPU plan in a test, and in the processes it starts, measures no machine unless it asks to,
    and nothing is written to the user's cache."""
    from tests.planning.machine_constants import fill

    folder = tmp_path_factory.mktemp("multigpu-cache")
    fill(folder)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MULTIGPU_CACHE_DIR", str(folder))
        yield


@pytest.fixture(autouse=True, scope="module")
def _earlier_files_frozen() -> None:
    """What the files before this one left alive (the libraries they imported: transformers, mlflow, aim, some
    100k objects) leaves the cyclic collector's sight, as collection's objects do (pytest_collection_finish)
    and as torch's do in a launched worker (launcher/_entry.py) before its script. Every full collection, and
    every ``gc.get_referrers`` (the scheduler lookup of a live heal, lr_schedulers.py), walked all of it
    again: late in a pytest-xdist worker, tests/session/test_heal_*.py and test_live_state_hostile.py took
    minutes, seconds on their own. What this file's tests create is collected and searched as before."""
    gc.collect()  # their garbage goes first, not into the permanent generation
    gc.freeze()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    env = dict(os.environ)
    threads = set(threading.enumerate())
    started = _started[0]
    yield
    problems = []
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        problems.append("left a process group initialized (destroy it, or close the Session)")
    changed = sorted(
        k
        for k in set(env) | set(os.environ)
        if env.get(k) != os.environ.get(k)
        and k != "PYTEST_CURRENT_TEST"
        and not (k in _SET_BY_LIBRARIES and k not in env)
    )
    if changed:
        os.environ.clear()
        os.environ.update(env)
        problems.append(f"changed environment variables {changed} (use monkeypatch.setenv)")
    alive = _new_threads(threads)
    if alive:
        problems.append(f"left threads running: {sorted(t.name for t in alive)}")
    if _started[0] > started and request.node.get_closest_marker("multiprocess") is None:
        problems.append("started processes without @pytest.mark.multiprocess")
    if problems:
        pytest.fail(f"{request.node.nodeid} " + "; ".join(problems), pytrace=False)


def _new_threads(before: set[threading.Thread], grace_s: float = 2.0) -> list[threading.Thread]:
    """Threads started by the test and still alive after a collection and a short grace period."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = [t for t in threading.enumerate() if t not in before and t.is_alive() and not _ours(t)]
        if not alive or time.monotonic() > deadline:
            return alive
        # only when a thread outlived its test: a collection per test cost 0.2-2.5 s each, the suite's
        # largest overhead; owners that were dropped shut their threads down when collected
        gc.collect()
        time.sleep(0.05)


def _ours(thread: threading.Thread) -> bool:
    """Threads of the test tooling itself (pytest-timeout's watchdog), not of the code under test."""
    return thread.name.startswith("pytest_timeout")


@pytest.fixture
def meta() -> Iterator[MetaDevice]:
    """The fake "meta" accelerator (tests/devices/fake_device.py), registered for the test."""
    if torch.cuda.is_available():
        pytest.skip("a real accelerator is found first; the fake type is looked up after it")
    device_type = register_device_type(MetaDevice())
    try:
        yield device_type  # type: ignore[misc]
    finally:
        unregister_device_type("meta")


def free_port() -> int:
    """A TCP port on the loopback address that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A real one-rank gloo process group on loopback for the test, torn down after it."""
    from multigpu.runtime import world
    from multigpu.runtime.world import LaunchEnv

    env = LaunchEnv(
        global_rank=0, local_rank=0, world_size=1, local_world_size=1, master_addr="127.0.0.1", master_port=free_port()
    )
    world.setup_process_group(env, torch.device("cpu"), timeout_s=30)
    try:
        yield
    finally:
        world.teardown_process_group()


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection built (torch, every test module, the items: some 300k objects) leaves the cyclic
    collector's sight for the rest of the session: each full collection walked all of it, a few dozen per
    file of in-process tests, a quarter of their time here (tests/parallel + tests/core: 28 collections,
    5.8 s of 21.8 s). Objects a test creates are collected as before; none of them is frozen."""
    gc.collect()  # import garbage goes first, not into the permanent generation
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # a pytest-xdist worker
        _processes_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible")
    for item in items:
        # The marker, not the keyword: every name on a test's path is a keyword (the tests/cuda/ folder,
        # a parametrize id), and only tests marked `cuda` run in ./scripts/gpu-check (pytest -m cuda).
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def _processes_first(items: list[pytest.Item]) -> None:
    """Files that start processes first, each file's tests in their order (a stable sort).

    ``./scripts/test`` hands files to its two workers in collection order (``--dist loadfile
    --no-loadscope-reorder``). xdist's own order, most tests first, left the files of one or two long
    multi-process tests (a minute each under load) to the end, where one worker ran them while the other,
    its queue empty, had stopped: about 60 s of the suite's 25 minutes at a load of 10. The in-process
    files, many short tests, now come last and even the two workers' ends out.
    """
    starting = {item.path for item in items if item.get_closest_marker("multiprocess") is not None}
    items.sort(key=lambda item: item.path not in starting)
