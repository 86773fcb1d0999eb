"""After a pre-emption signal: requeue the SLURM job (``multigpu launch --requeue``).

The workers' side is :attr:`multigpu.session.Session.should_stop`: on SIGTERM or SIGUSR1 every
rank agrees on one step, the loop saves its checkpoint and exits. The launcher forwards those
signals to the workers (torch elastic's agent for ddp, :mod:`multigpu.launcher.supervise` for one
process) and gives them ``--grace-period`` seconds; it then exits ``128 + N`` for signal ``N``
(143 for SIGTERM, 138 for SIGUSR1), so a job script can tell a pre-emption from success (0) and
failure (1). With ``--requeue`` inside a SLURM job, node rank 0's launcher then runs
``scontrol requeue $SLURM_JOB_ID``: SLURM starts the batch script again, and the script resumes
from the checkpoint the workers just wrote.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

from multigpu.errors import LaunchError
from multigpu.runtime.world import slurm_job_id

if TYPE_CHECKING:
    from multigpu.launcher.launch import LaunchConfig

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def stopped_by_preemption(code: int) -> bool:
    """Whether a launch's exit code says a pre-emption signal stopped it (``128 + SIGTERM/SIGUSR1``)."""
    return code in {128 + int(sig) for sig in PREEMPTION_SIGNALS}


def maybe_requeue(config: LaunchConfig, code: int) -> int:
    """Requeue the SLURM job when ``config.requeue`` asks and a pre-emption signal ended the launch.

    Returns:
        ``code`` unchanged (the requeue's own failure is reported on stderr, not hidden in the code).
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
    done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, check=False)
    if done.returncode == 0:
        print(f"multigpu launch: requeued SLURM job {job}", file=sys.stderr, flush=True)
    else:
        print(f"multigpu launch: scontrol requeue {job} failed: {done.stderr.strip()}", file=sys.stderr, flush=True)
    return code
