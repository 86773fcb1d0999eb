"""A fault-tolerant worker dies with the launcher that started it: a lost node leaves no worker behind.

``multigpu launch --fault-tolerant`` starts each replica group's workers in sessions of their own (so
that it can end a group and what the group started, :mod:`multigpu.launcher.process_groups`), and a
SIGKILLed launcher (a node's loss, an OOM kill) runs none of its cleanup: its workers would go on
training, heartbeating the lighthouse as a live group that nobody supervises or restarts. So a worker
the launcher started asks Linux to SIGKILL it when the launcher dies (``PR_SET_PDEATHSIG``), then checks
that the launcher (``MULTIGPU_SUPERVISOR``) is still its parent: one that died before the request was
made would never send it. Workers forked from the zygote are the zygote's children, which ends them
when the launcher's pipe closes (:mod:`multigpu.launcher.fault_tolerant_zygote`); they carry no
supervisor. Elsewhere than Linux this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with(supervisor: int) -> None:
    """SIGKILL this process when its parent dies; at once if its parent is not ``supervisor`` any more."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # refused (a sandbox): the launcher's own cleanup is all there is
    if os.getppid() != supervisor:  # the launcher died before the request: nobody will send the signal
        os.kill(os.getpid(), signal.SIGKILL)
