"""Turn the low-level errors of a broken collective into messages that name the likely cause.

When one rank stops calling a collective (it crashed, hangs, or took another code path), the
others block inside it until the process group's timeout expires and then see a backend error
such as gloo's "Timed out waiting 2000ms for recv operation to complete".
:func:`explain_collective_failures` re-raises such errors as :class:`CollectiveTimeoutError` or
:class:`PeerExitedError` saying what probably happened and what to change. The timeout is set
where the group is created: ``multigpu launch --collective-timeout SECONDS`` or
``Session(timeout_s=...)`` for a Session's group, ``init_process_group(timeout=...)`` for a group
the user creates.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from multigpu.errors import CollectiveTimeoutError, MultigpuError, PeerExitedError
from multigpu.runtime import tracking, world

_TIMEOUT = re.compile(r"timed? ?out|timeout|deadline", re.IGNORECASE)
_TIMEOUT_MS = re.compile(r"(\d+)\s*ms", re.IGNORECASE)
_PEER_ADDRESS = re.compile(r"\[[0-9A-Fa-f.:]+\]:\d+")
_PEER_GONE = re.compile(
    r"connection (closed|reset) by peer|broken pipe|connection refused|socket closed|\bEOF\b",
    re.IGNORECASE,
)


@contextlib.contextmanager
def explain_collective_failures(operation: str) -> Iterator[None]:
    """Re-raise a timed-out or broken collective inside the block with its likely cause.

    Args:
        operation: what the block does, in words ("all_reduce of the gradients", "checkpoint save").

    Every rank may use it; it adds no communication.

    Example:
        >>> with explain_collective_failures("the loss all_reduce"):
        ...     pass
    """
    try:
        yield
    except MultigpuError:
        raise
    except RuntimeError as exc:
        text = str(exc)
        if _TIMEOUT.search(text):
            tracking.request_peer_stacks()  # while the rank that never came still runs: the launcher shows it
            raise CollectiveTimeoutError(_timeout_message(operation, text)) from exc
        if _PEER_GONE.search(text):
            raise PeerExitedError(_peer_message(operation, text)) from exc
        raise


def _where() -> str:
    if world.in_process_group():
        return f"rank {world.global_rank()} of world_size {world.world_size()}"
    return "this process"


def _timeout_message(operation: str, text: str) -> str:
    found = _TIMEOUT_MS.search(text)
    after = f" after {int(found.group(1)) / 1000:g} s" if found else ""
    return (
        f"{operation} on {_where()} timed out{after}: the other ranks never joined the collective. "
        "Likely cause: another rank stopped calling it -- it crashed, is stuck (deadlock, endless "
        "loop, slow I/O), or took a different code path (a collective or save inside "
        "'if rank == 0'). Fix: make every rank call the same collectives in the same order; if a "
        "step legitimately takes longer, raise the collective timeout: multigpu launch "
        "--collective-timeout SECONDS, or Session(timeout_s=...) / SessionConfig(timeout_s=...) "
        "(if you create the process group yourself: init_process_group(timeout=...)). "
        "Backend said: " + text.strip().splitlines()[-1]
    )


def _peer_message(operation: str, text: str) -> str:
    found = _PEER_ADDRESS.search(text)  # gloo names the peer's address: on several nodes, it says which node
    peer = f" (the peer at {found.group(0)})" if found else ""
    return (
        f"{operation} on {_where()} failed because another rank{peer} exited (crashed or was killed) "
        "while this one waited for it. Look for the first failing rank's traceback above (on that "
        "node's launcher when it ran elsewhere); this error is a consequence, not the cause."
    )
