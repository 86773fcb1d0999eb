"""Run ``multigpu launch`` (or any command) in a subprocess with a timeout, and never leave it behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_command(
    argv: Sequence[str], *, timeout_s: float = 90, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in its own process group; on timeout kill the whole group (workers included)."""
    return run_together([argv], timeout_s=timeout_s, env=env)[0]


def run_together(
    argvs: Sequence[Sequence[str]], *, timeout_s: float = 90, env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """Run the commands at the same time (e.g. one launcher per node); on timeout kill them all, workers included."""
    procs = [
        subprocess.Popen(
            list(argv),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        for argv in argvs
    ]
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
