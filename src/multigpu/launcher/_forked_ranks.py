"""The forked ranks of :func:`~multigpu.launcher.function.launch_function`: start, watch, collect, end.

Each rank is a forked child in a session of its own. It writes one record into a folder the caller
owns (its result, or its exception) and exits; the caller watches the children themselves, not a pipe:
a helper a rank forked (a DataLoader worker) holds every descriptor the rank held, so an end-of-file
would wait for the helper too, and a pipe a dying rank had half-written would block its reader. A
record is written whole (to a side file, then renamed), so a rank killed while writing leaves none.

On the way out every process of each rank's session is killed: the rank's own process group (its
DataLoader workers) and any group a helper made for itself within the session
(:func:`multigpu.launcher.process_groups.end_sessions`).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from multigpu.errors import LaunchError, LaunchTimeoutError, ResultError
from multigpu.launcher.forked_start import apply_after_fork
from multigpu.launcher.process_groups import end_sessions
from multigpu.launcher.root_cause import is_consequence
from multigpu.runtime.worker_env import WorkerEnv

_GRACE_S = 5.0  # how long the other ranks get to exit after one failed (or the timeout), before SIGKILL
_POLL_S = 0.1  # how often the caller looks at children whose exit no descriptor announces

_FIX_RESULT = (
    "return plain data (numbers, strings, lists, dicts, tensors), or define its class at the top level of a "
    "module both this process and the ranks import (not in the function, the notebook, or a module only the "
    "ranks put on sys.path)"
)


def run_ranks(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    envs: list[dict[str, str]],
    *,
    timeout: float | None,
) -> Any:
    """Fork one child per environment of ``envs`` (rank i's is ``envs[i]``) running ``fn``; rank 0's result (raises as
    launch_function does)."""
    context = multiprocessing.get_context("fork")
    deadline = None if timeout is None else time.monotonic() + timeout
    children: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="multigpu-ranks-") as outbox:
        try:
            for rank, env in enumerate(envs):
                process = context.Process(
                    target=_child, args=(fn, args, kwargs, env, rank, Path(outbox, str(rank))), name=f"rank-{rank}"
                )
                process.start()
                children.append(process)
            return _collect(children, Path(outbox), deadline, timeout)
        finally:
            _end_all(children)


def _child(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], env: dict[str, str], rank: int, out: Path
) -> None:
    """One rank: its own session (so the caller can kill all it starts), the launcher's variables, ``fn``."""
    os.setsid()
    for name in WorkerEnv.variables():  # an outer launch's settings, if the caller is a launched process itself
        os.environ.pop(name, None)
    os.environ.update(env)
    apply_after_fork(env)  # forked, not started: what the caller's libraries read at start, applied now
    try:
        try:
            result = fn(*args, **kwargs)
        except SystemExit as done:  # sys.exit(0) (or None) on a rank is a clean end, as in a script
            if done.code not in (0, None):
                raise
            result = None
        # The caller stops a rank once its record is in: a checkpoint written in the background goes first
        from multigpu.checkpoint.ranks import finish_pending_writes  # here: the launcher stays torch-free

        finish_pending_writes()
        record = _result_record(result) if rank == 0 else ("ok", "NoneType", pickle.dumps(None))
    except BaseException as exc:
        try:
            original: bytes | None = pickle.dumps(exc)
        except Exception:  # an exception that does not pickle still reports its text and traceback
            original = None
        record = ("error", type(exc).__name__, str(exc), traceback.format_exc(), original)
    part = out.with_suffix(".part")
    part.write_bytes(pickle.dumps(record))
    os.replace(part, out)  # whole, or not at all


def _result_record(result: Any) -> tuple[Any, ...]:
    # on the CPU: a CUDA tensor unpickled in the caller would initialise CUDA there, and the next
    # launch_function (a fork) would then be refused
    from multigpu.core.structure import map_leaves  # here: importing the launcher stays torch-free

    name = f"{type(result).__module__}.{type(result).__qualname__}"
    try:
        return ("ok", name, pickle.dumps(map_leaves(_to_cpu, result)))
    except Exception as exc:  # a local class, a lambda, a generator, an open file...
        return ("unpicklable", name, f"{type(exc).__name__}: {exc}")


def _to_cpu(leaf: Any, _: str) -> Any:
    import torch

    return leaf.cpu() if isinstance(leaf, torch.Tensor) else leaf


class _Consequence(Exception):
    """A rank's error that says another rank failed first (it lost its peer): :attr:`error` is named only when
    no rank's own failure comes in within :data:`_GRACE_S`."""

    def __init__(self, error: LaunchError) -> None:
        super().__init__(str(error))
        self.error = error


def _collect(children: list[Any], outbox: Path, deadline: float | None, timeout: float | None) -> Any:
    """Wait for every rank; rank 0's result, or an error for the rank that failed first.

    The cause, not its consequence: a rank that lost its peer (``PeerExitedError``) often records its error before
    the rank that raised does (that one still runs its cleanup after closing its group), so a consequence is held
    until the other ranks have ended or :data:`_GRACE_S` has passed, and a rank's own failure in that time wins.
    """
    pending = dict(enumerate(children))
    result: Any = None
    held: LaunchError | None = None
    held_until = 0.0
    while pending:
        for rank, process in list(pending.items()):
            code = exit_code(process)
            record = outbox / str(rank)
            if code is None and not record.exists():  # (a rank with its record in is done: what it does while
                continue  # it exits, e.g. an atexit handler that hangs, is stopped with the rest)
            del pending[rank]
            try:
                value = _read(record, rank, len(children), code)
            except _Consequence as consequence:
                if held is None:
                    held, held_until = consequence.error, time.monotonic() + _GRACE_S
                continue
            if rank == 0:
                result = value
        if not pending:
            break
        if held is not None and time.monotonic() >= held_until:
            raise held
        if deadline is not None and time.monotonic() >= deadline:
            raise LaunchTimeoutError(
                f"launch_function's timeout={timeout} s passed with rank(s) {sorted(pending)} of {len(children)} still "
                "running (stopped now: SIGTERM, then SIGKILL); look for a rank waiting on another (a collective one "
                "rank skips) or a loop that never ends, or pass a larger timeout="
            )
        # a child's sentinel turns ready when it exits, unless a helper it forked holds the sentinel's pipe
        # too: then the next poll finds the exit
        left = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
        wait([p.sentinel for p in pending.values()], timeout=left)
    if held is not None:
        raise held
    return result


def _read(path: Path, rank: int, world: int, code: int | None) -> Any:
    try:
        record = pickle.loads(path.read_bytes())
    except FileNotFoundError:  # it died without a word (killed, os._exit, or killed while writing)
        raise LaunchError(
            f"rank {rank} of {world} exited with code {code} before returning; the other ranks were stopped"
        ) from None
    kind, *fields = record
    if kind == "error":
        name, text, trace, original = fields
        error = LaunchError(f"rank {rank} of {world} raised {name}: {text}\n\n{trace}")
        error.__cause__ = _unpickle_exception(original)
        if is_consequence(f"{name}: {text}"):
            raise _Consequence(error)
        raise error
    type_name, payload = fields
    if kind == "unpicklable":
        raise ResultError(f"rank {rank} returned a {type_name} that does not pickle ({payload}); {_FIX_RESULT}")
    try:
        return pickle.loads(payload)
    except Exception as exc:
        raise ResultError(
            f"rank {rank} returned a {type_name}, which this process cannot unpickle ({type(exc).__name__}: {exc}); "
            f"{_FIX_RESULT}"
        ) from exc


def _unpickle_exception(data: bytes | None) -> BaseException | None:
    if data is None:
        return None
    try:
        found = pickle.loads(data)
    except Exception:
        return None
    return found if isinstance(found, BaseException) else None


def exit_code(process: Any) -> int | None:
    """A child's exit code (negative: the signal that ended it), None while it runs.

    The child is left unreaped (``process.exitcode`` would reap it), so its pid, the id of its session and
    process group, cannot be taken by another process before :func:`_end_all` has killed what it left."""
    if not hasattr(os, "waitid"):  # (macOS before Python 3.13): reaps it; only the session scan is lost
        return None if process.is_alive() else int(process.exitcode)
    try:
        info = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already: it has ended, with the code multiprocessing saw (if it did)
        code = process.exitcode
        return int(code) if code is not None else 1
    if info is None or info.si_pid == 0:
        return None
    return int(info.si_status) if info.si_code == os.CLD_EXITED else -int(info.si_status)


def _end_all(children: list[Any]) -> None:
    """Stop every child still running (SIGTERM, then SIGKILL after the grace), kill what each started, and
    wait until it is gone (:func:`multigpu.launcher.process_groups.end_sessions`): the call returns with no
    process of theirs left."""
    end_sessions([p.pid for p in children if p.pid is not None], grace_s=_GRACE_S)
    for process in children:
        process.join()
