"""The one way tests start processes: through here, and distributed runs through ``multigpu launch``.

Every multi-process test goes through here: :func:`launch_workers` for the common case (a worker
script on N gloo processes), :func:`multigpu_launch` for any launcher flags, :func:`run_together`
for several launchers at once (one per node), :func:`start_launch` for a launcher the test signals.
The launcher binds the rendezvous itself (no "free port" picked here and raced for), and a run
that passes its timeout is killed with every process it started. Tests that need a plain Python
process (a saver killed mid-write, a CLI command) use :func:`start_python` / :func:`run_command`,
which start it the same way: in a session of its own, in the repository root, ``tests`` importable.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start(argv: Sequence[str], *, env: Mapping[str, str] | None = None, stdin: bool = False) -> subprocess.Popen[str]:
    """``argv`` started in a session of its own (signals sent to it reach it alone; :func:`kill_tree` ends it
    and its descendants), in the repository root with ``tests`` importable, stdout and stderr piped (and
    stdin when asked)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.Popen(
        list(argv),
        cwd=ROOT,
        stdin=subprocess.PIPE if stdin else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
    )


def start_python(*argv: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """``python ARGV`` with this interpreter, started by :func:`start` (a process the test talks to or kills)."""
    return start([sys.executable, *argv], env=env)


def finished_pid() -> int:
    """The id of a process that has run and been reaped: a pid that no process holds now."""
    child = start_python("-c", "pass")
    child.communicate(timeout=60)
    return child.pid


def run_command(
    argv: Sequence[str], *, timeout_s: float = 90, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in its own process group; on timeout kill the whole group (workers included)."""
    return run_together([argv], timeout_s=timeout_s, env=env)[0]


def run_together(
    argvs: Sequence[Sequence[str]],
    *,
    timeout_s: float = 90,
    env: Mapping[str, str] | None = None,
    envs: Sequence[Mapping[str, str]] | None = None,
) -> list[subprocess.CompletedProcess[str]]:
    """Run the commands at the same time (e.g. one launcher per node, or one process per rank with ``envs``,
    one environment each); on timeout kill them all, workers included."""
    procs = [start(argv, env={**(env or {}), **(envs[i] if envs else {})}) for i, argv in enumerate(argvs)]
    deadline = time.monotonic() + timeout_s
    done = []
    try:
        for argv, proc in zip(argvs, procs):
            try:
                out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for other in procs:
                    _kill_tree(other)
                out, err = proc.communicate()
                raise AssertionError(f"{' '.join(argv)} ran past {timeout_s}s and was killed\n{out}\n{err}") from None
            done.append(subprocess.CompletedProcess(list(argv), proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                _kill_tree(proc)
    return done


def start_launch(
    *args: str, wrapper: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    """``multigpu launch ARGS`` started by :func:`start` (signals sent to it reach it alone); stop it with
    :func:`kill_tree`. ``wrapper`` goes before the interpreter (e.g. ``ip netns exec NODE``)."""
    return start([*wrapper, sys.executable, "-m", "multigpu", "launch", *args], env=env)


def run_python_stdin(source: str, *, timeout_s: float = 90) -> subprocess.CompletedProcess[str]:
    """``python -`` reading ``source`` from stdin (a script with no file, as a notebook's code has none);
    on timeout it is killed with every process it started."""
    proc = start([sys.executable, "-"], stdin=True)
    try:
        out, err = proc.communicate(source, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, err = proc.communicate()
        raise AssertionError(f"python - ran past {timeout_s}s and was killed\n{out}\n{err}") from None
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    return subprocess.CompletedProcess(["python", "-"], proc.returncode, out, err)


def read_lines_until(proc: subprocess.Popen[str], prefix: str, count: int, *, timeout_s: float) -> list[str]:
    """The first ``count`` lines of ``proc``'s stdout that start with ``prefix`` (AssertionError after ``timeout_s``)."""
    found: list[str] = []
    done = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(prefix):
                found.append(line.strip())
                if len(found) == count:
                    break
        done.set()

    threading.Thread(target=read, daemon=True).start()
    if not done.wait(timeout_s) or len(found) < count:
        kill_tree(proc)
        raise AssertionError(
            f"{proc.args}: {len(found)} of {count} {prefix!r} lines (output ended, or {timeout_s} s passed)\n{proc.stderr.read() if proc.stderr else ''}"
        )
    return found


def fork_sleeper(*, own_group: bool = False, seconds: float = 300.0) -> int:
    """Fork this process into a child that sleeps ``seconds`` then exits: the helper a process leaves behind
    (as a DataLoader worker would, holding every descriptor its parent held); its pid. ``own_group``: the
    child first makes a process group of its own."""
    pid = os.fork()
    if pid == 0:
        if own_group:
            os.setpgid(0, 0)
        time.sleep(seconds)
        os._exit(0)
    return pid


def start_joined_child(seconds: float = 300.0) -> int:
    """A non-daemon multiprocessing child sleeping ``seconds``, which this process's exit waits for
    (multiprocessing joins such children on the way out); its pid."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(seconds,))
    child.start()
    assert child.pid is not None
    return child.pid


def alive(pids: list[int]) -> list[int]:
    """The processes of ``pids`` that still run (zombies, which have ended, excluded)."""
    running = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            running.append(pid)
    return running


def kill_tree(proc: subprocess.Popen[str]) -> None:
    """SIGKILL ``proc`` and every descendant, and reap ``proc``."""
    _kill_tree(proc)
    proc.wait()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, ...)."""
    return _descendants(pid)


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    """Kill the launcher and every descendant: torch elastic starts workers in sessions of their own."""
    for pid in [*_descendants(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def multigpu_launch(*args: str, timeout_s: float = 90) -> subprocess.CompletedProcess[str]:
    """``multigpu launch ARGS`` with this interpreter."""
    return run_command([sys.executable, "-m", "multigpu", "launch", *args], timeout_s=timeout_s)


def launch_workers(
    worker: Path | str, *args: str, nproc: int | str = 2, timeout_s: float = 90
) -> subprocess.CompletedProcess[str]:
    """``worker`` on ``nproc`` processes (``multigpu launch --strategy ddp``; gloo on the CPU); fails the
    test with the launcher's output when a worker fails."""
    done = multigpu_launch("--strategy", "ddp", "--nproc-per-node", str(nproc), str(worker), *args, timeout_s=timeout_s)
    assert done.returncode == 0, (
        f"{worker} failed (exit {done.returncode})\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done
