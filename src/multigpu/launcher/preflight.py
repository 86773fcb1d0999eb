"""Checks a launcher runs before it starts anything: each turns a slow or noisy failure into a LaunchError now.

Without them, a master address that is not this machine's made the rendezvous store retry for
71 s and print 211 lines before failing, and a port already in use timed out later still.

Example:
    >>> check_listen_address("127.0.0.1", 0)   # a local address: passes
"""

from __future__ import annotations

import errno
import socket

from multigpu.errors import LaunchError


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
