"""A warm spare for ``multigpu launch --fault-tolerant``: restarted workers are forked with their imports done.

A restarted replica group spent most of its way back importing: torch, torchft, multigpu, and
``torch._dynamo``, which ``DistributedDataParallel``'s constructor imports on first use (4-8 s on a
2-core machine, against well under a second for the join and the state's transfer). So, when groups may
be restarted, the launcher starts one *zygote* per node right after the groups
(:class:`Zygote`): a process with the workers' environment that imports all of that
(:data:`WARM_MODULES`) and then only waits. A restart asks it for each worker: it forks, and the child
sets the worker's variables, applies what a started process would have read at its start
(:func:`~multigpu.launcher.forked_start.apply_after_fork`) and runs the script through
:mod:`multigpu.launcher._entry`, as a spawned worker does. The zygote runs nothing else, so each fork
starts from the same clean state.

Fork after threads is unsafe (a lock held by another thread stays held in the child): the zygote
imports with BLAS's thread pool held at one thread (numpy's OpenBLAS starts its pool at import; the
child sets the size a started worker would have, through ``threadpoolctl`` where installed), starts no
work, installs no signal handler, and checks that it is alone in its process before it serves. A
zygote that found threads, died, or is still importing after :data:`READY_WAIT_S` is passed by: the launcher starts the worker as
a new interpreter, as before (:meth:`Zygote.start_worker` returns None).

The forked workers are the zygote's children, not the launcher's: the zygote reports each exit
(without reaping, so the pid, the id of the worker's session, cannot be reused), and on
:meth:`Zygote.end` kills what is left of the workers' sessions and reaps them
(:func:`~multigpu.launcher.process_groups.end_sessions`). When the launcher goes away (its end of the
pipe closes) the zygote does the same to every worker it forked, then exits.

The protocol, one JSON object a line: requests ``{"fork": {"env": ..., "argv": ...}}`` and
``{"end": [pid, ...]}`` on the request pipe; answers ``{"ready": true}`` (or ``{"refused": why}``),
``{"pid": n}``, ``{"exited": pid, "code": c}`` (``Popen.returncode``'s form) and ``{"ended": [...]}``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from multigpu.launcher.process_groups import end_sessions, exit_status, session_members

# what every worker imports before its first step; torch._dynamo: DistributedDataParallel's constructor imports it
WARM_MODULES = (
    "numpy",
    "torch",
    "torch._dynamo",
    "torch.nn.parallel.distributed",
    "torch.distributed.elastic.multiprocessing.errors",
    "torchft.manager",
    "torchft.process_group",
    "multigpu.session",
    "multigpu.launcher._entry",
)
READY_WAIT_S = 30.0  # how long a restart waits for a zygote still importing (one stuck in an import is passed by)
FORK_TIMEOUT_S = 10.0  # how long a restart waits for the zygote to answer a fork before it starts the worker itself
END_TIMEOUT_S = 20.0  # how long the launcher waits for the zygote to end a group's workers (its sweep is bounded)
_POLL_S = 0.02


class ForkedWorker:
    """A worker the zygote forked: the part of ``subprocess.Popen`` the launcher uses (pid, poll, returncode)."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid, self._zygote = pid, zygote

    @property
    def returncode(self) -> int | None:
        return self._zygote.exit_code(self.pid)

    def poll(self) -> int | None:
        return self.returncode


class Zygote:
    """The launcher's handle on its zygote: start it, ask it for workers, end them.

    Args:
        env: the environment every worker shares (the launch's, without the per-rank variables).
    """

    def __init__(self, env: Mapping[str, str]) -> None:
        request_read, self._requests = os.pipe()
        self._answers_read, answer_write = os.pipe()
        zygote_env = {**env, "OPENBLAS_NUM_THREADS": "1"}  # numpy's pool stays unstarted; the child resizes it
        # -c, not -m: the package imports this module, and runpy warns about running a module already imported
        run = f"from {__name__} import main; main()"
        argv = [sys.executable, "-c", run, str(request_read), str(answer_write)]
        self.process = subprocess.Popen(
            argv, env=zygote_env, pass_fds=(request_read, answer_write), start_new_session=True
        )
        os.close(request_read)
        os.close(answer_write)
        self.ready = threading.Event()
        self.refused: str | None = None
        self._lock = threading.Condition()
        self._codes: dict[int, int] = {}
        self._pids: list[int] = []
        self._ended: set[int] = set()
        self._reader = threading.Thread(target=self._read, name="zygote-answers", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None and self._reader.is_alive()

    def start_worker(
        self, env: Mapping[str, str], argv: Sequence[str], *, ready_wait_s: float = READY_WAIT_S
    ) -> ForkedWorker | None:
        """A worker forked with ``env`` running ``python -m multigpu.launcher._entry argv...``; None when the
        zygote cannot serve (refused, dead, or still importing after ``ready_wait_s``): the caller starts
        the worker itself. A zygote still importing is waited for: it started before the restart, so it is
        done before a new interpreter started now would be."""
        deadline = time.monotonic() + ready_wait_s
        while not self.ready.wait(_POLL_S) and self.alive and time.monotonic() < deadline:
            pass
        if not self.ready.is_set() or self.refused is not None or not self.alive:
            return None
        with self._lock:
            known = len(self._pids)
            if not self._send({"fork": {"env": dict(env), "argv": list(argv)}}):
                return None
            if not self._lock.wait_for(lambda: len(self._pids) > known or not self.alive, FORK_TIMEOUT_S):
                return None
            return ForkedWorker(self._pids[known], self) if len(self._pids) > known else None

    def exit_code(self, pid: int) -> int | None:
        """The worker's exit code once the zygote reported it (None while it runs)."""
        with self._lock:
            return self._codes.get(pid)

    def end(self, workers: Sequence[ForkedWorker]) -> None:
        """SIGKILL the workers and what they started, and have the zygote reap them (bounded time)."""
        pids = [w.pid for w in workers]
        if not pids:
            return
        with self._lock:
            if self._send({"end": pids}):
                self._lock.wait_for(lambda: self._ended.issuperset(pids) or not self.alive, END_TIMEOUT_S)
            if self._ended.issuperset(pids):
                return
        _kill_orphans(pids)  # the zygote is gone: its workers went to init with it, ended from here

    def close(self) -> None:
        """End the zygote: it kills every worker it forked, reaps them, and exits."""
        with contextlib.suppress(OSError):
            os.close(self._requests)
        try:  # a zygote still importing has forked nothing and reads no request yet: ended at once
            self.process.wait(timeout=END_TIMEOUT_S if self.ready.is_set() else 0)
        except subprocess.TimeoutExpired:
            end_sessions([self.process.pid], grace_s=0.0, first=None)
            self.process.wait()
        self._reader.join(5)

    def _send(self, message: dict[str, Any]) -> bool:
        try:
            os.write(self._requests, (json.dumps(message) + "\n").encode())
        except OSError:  # the zygote is gone
            return False
        return True

    def _read(self) -> None:
        with os.fdopen(self._answers_read, "r") as answers:
            for line in answers:
                message = json.loads(line)
                with self._lock:
                    if "pid" in message:
                        self._pids.append(int(message["pid"]))
                    elif "exited" in message:
                        self._codes[int(message["exited"])] = int(message["code"])
                    elif "ended" in message:
                        for pid, code in message["ended"]:
                            self._codes.setdefault(int(pid), int(code))
                            self._ended.add(int(pid))
                    elif "refused" in message:
                        self.refused = str(message["refused"])
                    self._lock.notify_all()
                if "ready" in message or "refused" in message:
                    self.ready.set()
        # the zygote is gone: the workers it forked are nobody's children now, and their exits are never reported;
        # they are ended (as a lost group's are) and reported killed, so that their groups restart
        with self._lock:
            orphans = [pid for pid in self._pids if pid not in self._codes]
            if orphans:
                print(
                    f"multigpu launch: the zygote restarted workers are forked from died (exit {self.process.wait()}); "
                    f"its workers {orphans} are ended, and restarts start new interpreters from now on",
                    file=sys.stderr,
                    flush=True,
                )
            _kill_orphans(orphans)
            self._codes.update({pid: -signal.SIGKILL for pid in orphans})
            self._ended.update(orphans)
            self._lock.notify_all()


def _kill_orphans(pids: Sequence[int]) -> None:
    """SIGKILL every process of the sessions ``pids`` led (by session id: a pid reused since is not one of them)."""
    for _ in range(100):
        left = session_members(set(pids))
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(_POLL_S)


# -- the zygote process ---------------------------------------------------------------------------------


def serve(requests: IO[str], answers: IO[str]) -> None:
    """The zygote's loop: fork workers on request, report their exits, end them; returns at end of file."""
    children: dict[int, int | None] = {}  # pid -> exit code once reported

    def answer(message: dict[str, Any]) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    for name in WARM_MODULES:
        importlib.import_module(name)
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads != 1:
        answer({"refused": f"{threads} threads after the imports: forking would copy their locks"})
        return
    answer({"ready": True})
    buffer = ""
    try:
        while True:
            readable, _, _ = select.select([requests], [], [], _POLL_S)
            if readable:
                chunk = os.read(requests.fileno(), 1 << 16).decode()
                if not chunk:
                    return
                buffer += chunk
                while "\n" in buffer:
                    line, buffer = buffer.split("\n", 1)
                    _handle(json.loads(line), children, answer, (requests, answers))
            for pid, code in list(children.items()):
                if code is None and (status := exit_status(pid)) is not None:
                    children[pid] = status
                    answer({"exited": pid, "code": status})
    finally:
        _end([pid for pid in children], children)


class _Forked(BaseException):
    """Raised in a forked child: unwinds the zygote's frames, so the worker runs (and exits) as a new process's main."""

    def __init__(self, env: dict[str, str], argv: list[str]) -> None:
        super().__init__()
        self.env, self.argv = env, argv


def _handle(message: dict[str, Any], children: dict[int, int | None], answer: Any, pipes: tuple[IO[str], ...]) -> None:
    if "fork" in message:
        pid = os.fork()
        if pid == 0:
            children.clear()  # the zygote's, not this worker's: nothing to end on the way out
            os.setsid()  # a session of its own, as the launcher starts workers: it ends the session with the worker
            for pipe in pipes:  # closed through their file objects: a stale one would close a reused descriptor
                pipe.close()
            raise _Forked(message["fork"]["env"], message["fork"]["argv"])
        children[pid] = None
        answer({"pid": pid})
    elif "end" in message:
        pids = [pid for pid in message["end"] if pid in children]
        answer({"ended": _end(pids, children)})


def _end(pids: list[int], children: dict[int, int | None]) -> list[tuple[int, int]]:
    if not pids:
        return []
    end_sessions(pids, grace_s=0.0, first=None)
    ended = []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        ended.append((pid, os.waitstatus_to_exitcode(status)))
        children.pop(pid, None)
    return ended


def _start_like_a_new_process(env: Mapping[str, str]) -> None:
    """What a new interpreter would differ in: the thread settings read at import, numpy's random seed."""
    from multigpu.launcher.forked_start import apply_after_fork
    from multigpu.runtime.worker_env import WorkerEnv

    apply_after_fork(env)
    import numpy as np

    np.random.seed()  # a new process draws its seed from the OS; a fork would share the zygote's
    blas = env.get("OPENBLAS_NUM_THREADS") or str(WorkerEnv.read(env, "threads") or "")  # OMP_NUM_THREADS, as a count
    if blas.isdigit() and int(blas) > 1:
        with contextlib.suppress(ImportError):
            from threadpoolctl import threadpool_limits

            threadpool_limits(int(blas), user_api="blas")


def main() -> None:
    requests = os.fdopen(int(sys.argv[1]), "r")
    answers = os.fdopen(int(sys.argv[2]), "w")
    try:
        serve(requests, answers)
    except _Forked as forked:  # this process is a forked worker now: nothing of the zygote's is left on the stack
        os.environ.clear()
        os.environ.update(forked.env)
        _start_like_a_new_process(forked.env)
        from multigpu.launcher import _entry

        sys.argv = [_entry.__file__, *forked.argv]  # as ``python -m multigpu.launcher._entry script args`` has it
        _entry.main()  # its exit (code, uncaught exception, atexit, threads) is the interpreter's, as in any worker


if __name__ == "__main__":
    main()
