"""Checks a launcher runs before it starts anything: each turns a slow or noisy failure into a LaunchError now.

Without them, a master address that is not this machine's made the rendezvous store retry for
71 s and print 211 lines before failing, and a port already in use timed out later still.

Example:
    >>> check_listen_address("127.0.0.1", 0)   # a local address: passes
    >>> check_process_count(2, "--nproc-per-node ", fix="")
"""

from __future__ import annotations

import errno
import os
import socket
import tempfile

from multigpu.core.limits import MIN_PROCESS_BOUND, PROCESSES_PER_CORE, process_bound
from multigpu.errors import ConfigError, LaunchError


def check_listen_address(addr: str, port: int) -> None:
    """Fail early, with the fix, when rank 0 cannot listen on ``addr:port`` (instead of a store timeout later).

    Single-node runs bind the rendezvous store on ``addr``. The address family comes from ``addr``
    (``::1`` binds an IPv6 socket). Only "address in use" means the port is taken. Port 0 checks
    the address alone (the store then picks its port itself).

    Raises:
        LaunchError: something listens there already, ``addr`` is not one of this machine's
            addresses (or does not resolve), or the OS refuses the bind (the reason is shown).
    """
    use_local = "single-node runs bind there: pass --master-addr 127.0.0.1, or leave --master-addr out"
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise LaunchError(f"master address {addr!r} does not resolve ({exc.strerror}); {use_local}") from exc
    with socket.socket(family, kind, proto) as sock:
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise LaunchError(
                    f"master port {port} on {addr} is in use ({exc.strerror}); pass another --master-port, "
                    "or leave it out to pick a free port"
                ) from exc
            if exc.errno == errno.EADDRNOTAVAIL:
                raise LaunchError(
                    f"master address {addr} is not one of this machine's addresses ({exc.strerror}); {use_local}"
                ) from exc
            # e.g. EACCES for a port below 1024: neither "in use" nor a foreign address.
            raise LaunchError(
                f"cannot listen on master port {port} on {addr} ({exc.strerror}); {use_local}, and pass a "
                "--master-port of 1024 or more, or leave it out"
            ) from exc


def check_process_count(count: int, flag: str, *, fix: str) -> None:
    """Refuse a process count no node can run (``--nproc-per-node 10000`` would fork until memory runs out).

    Every rank is a whole Python process with torch loaded (hundreds of MB), sharing this node's cores: past
    :func:`~multigpu.core.limits.process_bound` they only wait for each other, so such a count is a typo, not a plan.

    Raises:
        ConfigError: naming ``flag`` with ``count``, the bound, where it comes from, and ``fix``.
    """
    bound = process_bound()
    if count > bound:
        raise ConfigError(
            f"{flag}{count}: more processes than this node runs (at most {bound}: {PROCESSES_PER_CORE} per CPU core "
            f"of its {os.cpu_count() or 1}, and at least {MIN_PROCESS_BOUND}); pass at most {bound}"
            + (f", or {fix}" if fix else "")
        )


def check_log_dir(path: str) -> None:
    """Create ``--log-dir`` now (as torchrun would) and check a file can be written in it.

    Raises:
        LaunchError: naming the path and the OS reason (``/dev/null/logs``: not a directory; a read-only
            folder: permission denied), before any process starts.
    """
    if not path:
        raise LaunchError("--log-dir '' is empty; pass a folder, e.g. --log-dir logs")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise LaunchError(
            f"--log-dir {path}: cannot write there ({exc.strerror or exc}); pass a folder this user can create "
            "and write, e.g. --log-dir logs"
        ) from exc
