"""After a pre-emption signal: requeue the SLURM job (``multigpu launch --requeue``).

The workers' side is :attr:`multigpu.session.Session.should_stop`: on SIGTERM or SIGUSR1 every
rank agrees on one step, the loop saves its checkpoint and exits. The launcher forwards those
signals to the workers (torch elastic's agent for ddp, :mod:`multigpu.launcher.supervise` for one
process) and gives them ``--grace-period`` seconds; it then exits ``128 + N`` for signal ``N``
(143 for SIGTERM, 138 for SIGUSR1), so a job script can tell a pre-emption from success (0) and
failure (1). With ``--requeue`` inside a SLURM job, node rank 0's launcher then runs
``scontrol requeue $SLURM_JOB_ID``: SLURM starts the batch script again, and the script resumes
from the checkpoint the workers just wrote. ``scontrol`` gets :data:`REQUEUE_TIMEOUT_S`; whatever it does
(hangs, cannot start, fails, prints garbage) is reported on stderr and the exit code stays the
pre-emption's.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import threading
from typing import IO

from multigpu.errors import LaunchError
from multigpu.launcher.config import LaunchConfig
from multigpu.launcher.process_groups import end_sessions
from multigpu.runtime.world import slurm_job_id

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# scontrol answers in a second when SLURM's controller does; SLURM kills the job KillWait (30 s by default)
# after its SIGTERM, so waiting longer would only lose the exit code
REQUEUE_TIMEOUT_S = 20.0
_KEEP_BYTES = 4000  # of scontrol's output: its error message


def stopped_by_preemption(code: int) -> bool:
    """Whether a launch's exit code says a pre-emption signal stopped it (``128 + SIGTERM/SIGUSR1``)."""
    return code in {128 + int(sig) for sig in PREEMPTION_SIGNALS}


def maybe_requeue(config: LaunchConfig, code: int, *, timeout_s: float = REQUEUE_TIMEOUT_S) -> int:
    """Requeue the SLURM job when ``config.requeue`` asks and a pre-emption signal ended the launch.

    ``scontrol`` gets ``timeout_s`` seconds; one that hangs is killed (with anything it started), one that
    cannot run or fails is reported on stderr with the command and the fix.

    Returns:
        ``code`` unchanged, whatever ``scontrol`` did: a job script still tells a pre-emption (143 for
        SIGTERM, 138 for SIGUSR1) from a failure (1).
    """
    if not config.requeue or not stopped_by_preemption(code) or config.node_rank != 0:
        return code
    try:
        job = slurm_job_id()
    except LaunchError as exc:  # reported, not raised: the launch's own exit code stays the answer
        print(f"multigpu launch: --requeue: {exc}", file=sys.stderr, flush=True)
        return code
    if job is None:
        print(
            "multigpu launch: --requeue: not inside a SLURM job (no SLURM_JOB_ID); nothing to requeue", file=sys.stderr
        )
        return code
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        print("multigpu launch: --requeue: 'scontrol' is not on PATH; requeue the job by hand", file=sys.stderr)
        return code
    command = f"scontrol requeue {job}"
    fix = f"the job was not requeued: requeue it by hand ({command}), or check that SLURM's controller answers (scontrol ping)"
    try:
        returncode, said = _run([scontrol, "requeue", job], timeout_s=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"multigpu launch: --requeue: '{command}' did not answer within {timeout_s:g} s; {fix}", file=sys.stderr)
        return code
    except OSError as exc:
        print(f"multigpu launch: --requeue: '{command}' could not run ({scontrol}: {exc}); {fix}", file=sys.stderr)
        return code
    if returncode == 0:
        print(f"multigpu launch: requeued SLURM job {job}", file=sys.stderr, flush=True)
    else:
        ending = f"exit code {returncode}" if returncode > 0 else f"killed by signal {-returncode}"
        print(
            f"multigpu launch: --requeue: '{command}' failed ({ending}): {said or '(no message)'}; {fix}",
            file=sys.stderr,
        )
    sys.stderr.flush()
    return code


def _run(argv: list[str], *, timeout_s: float) -> tuple[int, str]:
    """Run ``argv`` for at most ``timeout_s`` seconds: its exit code and the end of its output, as text.

    It runs in a session of its own, so a timeout kills what it started too (a shell script's ``sleep``
    would otherwise hold the pipe open); its output is read by a thread that keeps only its end, so a
    command that prints without end neither blocks nor fills the memory.

    Raises:
        subprocess.TimeoutExpired: it did not end in time (it and its group were killed).
        OSError: it could not be started.
    """
    child = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    assert child.stdout is not None
    kept = bytearray()
    reader = threading.Thread(target=_keep_end, args=(child.stdout, kept), daemon=True)
    reader.start()
    try:
        returncode = child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        end_sessions([child.pid], grace_s=0.0, first=None)  # a hung scontrol: SIGKILL, with all it started
        child.wait()
        raise
    finally:
        reader.join(timeout=1.0)  # what it started may keep the pipe open: never wait for them
        if not reader.is_alive():
            child.stdout.close()
    said = bytes(kept).decode(errors="replace").strip()
    return returncode, " ".join(said.split())[-_KEEP_BYTES:]


def _keep_end(stream: IO[bytes], kept: bytearray) -> None:
    with contextlib.suppress(OSError, ValueError):
        while chunk := stream.read1(65536):  # type: ignore[attr-defined]
            kept += chunk
            del kept[: max(0, len(kept) - _KEEP_BYTES)]
