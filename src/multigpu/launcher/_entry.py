"""The worker entry point ``multigpu launch`` runs each ddp process through: the user's script, recorded.

``python -m multigpu.launcher._entry script.py [args]`` runs ``script.py`` as ``__main__``
(as ``python script.py [args]`` would: :func:`multigpu.core.script.run_as_main`)
inside torch elastic's ``@record``, which writes an uncaught exception to the error file the
agent reads, and records the failure for the launcher (:mod:`multigpu.runtime.failure_records`; a
Session records it earlier, before its process group closes). The launcher's failure summary then
shows the failing rank and its traceback without the user decorating anything. When the launcher asks for it, the process first binds to its share
of the node's cores (:mod:`multigpu.launcher.affinity`), before the script starts any thread. It
also gets ready to write its stacks on request and its ledger of collectives
(:func:`multigpu.runtime.tracking.setup_worker`), which the failure summary of a hang reads, and,
unless the user asked for torchrun's log files, copies its stderr into the failure folder through
``tee`` (what gloo or NCCL print from C++ before they abort the process, for the summary). A SIGTERM
or SIGHUP that ends it is recorded with its time (:mod:`multigpu.launcher.signal_witness`), so the
summary can tell a rank a signal stopped first from the ones the launcher stopped after. When the
script returns, that is marked too (:func:`multigpu.runtime.failure_records.record_finished`): a rank
that dies after it (a library's thread aborting as the process exits) is reported as dying at exit.
What the process holds before the script starts (torch's modules, some 170k objects) is frozen
(``gc.freeze``): every full collection of the cyclic collector walked it again, the Session's at close
included, about 0.3 s a rank on the 2-core machine; what the script creates is collected as before.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from multigpu.core.run_files import open_appending
from multigpu.core.script import run_as_main
from multigpu.launcher import signal_witness
from multigpu.launcher.affinity import bind_to_core_share
from multigpu.launcher.die_with_parent import die_with
from multigpu.runtime import failure_records, preemption, tracking, world


@record
def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m multigpu.launcher._entry script.py [args]")
    script = sys.argv[1]
    supervisor = world.supervisor_pid()
    if supervisor is not None:  # --fault-tolerant: dies with its launcher, before anything else starts
        die_with(supervisor)
    env = world.read_launch_env()
    if env is not None and world.bind_cores_requested():
        bind_to_core_share(env.local_rank, env.local_world_size)
    tracking.setup_worker()
    folder = world.failure_dir()
    if folder is not None:  # a SIGTERM/SIGHUP that ends this rank is recorded with its time, for the summary
        signal_witness.install(failure_records.record_signal)
    if folder is not None and world.stderr_copy_requested():
        _copy_stderr(tracking.stderr_copy_path(folder, attempt=world.restart_count(), rank=world.global_rank()))
    gc.freeze()  # see the module's docstring: nothing of the script's is frozen
    try:
        run_as_main(script, sys.argv[2:])
    except SystemExit as exc:
        if exc.code not in (None, 0):
            failure_records.record(exc)
        else:
            _left_at_a_stop_signal()
            failure_records.record_finished()
        raise
    except BaseException as exc:
        failure_records.record(exc)  # a no-op when the Session already recorded it before closing its group
        raise
    _left_at_a_stop_signal()
    # the script is done: a death from here on (a library's thread aborting at exit) is named as one
    failure_records.record_finished()


def _left_at_a_stop_signal() -> None:
    """Under ``--fault-tolerant``, a script that returned after a stop signal (``session.should_stop``) ends with
    ``128 + signal``: its replica group stopped, it did not finish the run (:mod:`multigpu.launcher.fault_tolerant`
    restarts it, or ends the launch when the signal came through the launcher)."""
    signum = preemption.stop_signal_received()
    if signum is not None and world.replica_group() is not None:
        raise SystemExit(128 + signum)


def _copy_stderr(path: os.PathLike[str]) -> None:
    """Send this process's stderr (file descriptor 2, so C++ output too) through ``tee`` into ``path`` as well.

    ``tee`` is a process of its own, in a session of its own: it outlives an abort of this one (and the
    agent's signals to its group) and copies what is left in the pipe; a write error on the file (a full
    disk) leaves the console copy going. It ends when every writer has closed the pipe.
    """
    sys.stderr.flush()
    try:
        os.close(open_appending(path))  # a regular file: tee would block on a FIFO planted there, and this rank with it
        copier = subprocess.Popen(["tee", "-a", os.fspath(path)], stdin=subprocess.PIPE, start_new_session=True)
    except OSError:  # no tee on this system: the console keeps stderr, the summary goes without it
        return
    assert copier.stdin is not None
    os.dup2(copier.stdin.fileno(), 2)
    copier.stdin.close()  # fd 2 now holds the pipe; tee sees its end when this process (and its children) exit


if __name__ == "__main__":
    main()
