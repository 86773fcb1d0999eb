"""Run a function on several processes from a notebook or any script: :func:`launch_function`.

``multigpu launch`` starts a ``.py`` file; a function typed in a notebook cell, or in a script read
from stdin, has no file to start. :func:`launch_function` forks ``nproc_per_node`` children from
the calling process (fork copies the function, whatever defined it), gives each the variables a
launcher would (``RANK``, ``WORLD_SIZE``, ...), so ``Session(strategy="ddp")`` inside the function
joins one process group, and waits. The caller is no rank: it holds the rendezvous store (bound on
port 0, so no port is raced for) and collects the results.

- rank 0's return value is returned (it must pickle); the others' are dropped;
- an exception on any rank ends the other ranks and is raised in the caller as a
  :class:`~multigpu.errors.LaunchError` naming the rank, with its traceback (the original
  exception is chained when it pickles);
- no child survives: each runs in a process group of its own that is killed on the way out
  (DataLoader workers included), on success, failure, or Ctrl-C in the caller;
- calling it again starts fresh children and a fresh store.

Where it cannot work it says so: CUDA already initialised in the caller (a forked child cannot use
it: restart the kernel and call ``launch_function`` before anything touches the GPU), or a
platform without fork.

Example (a notebook cell)::

    def train(lr):
        with multigpu.Session(strategy="ddp") as session:
            ...
            return final_loss

    loss = multigpu.launch_function(train, args=(0.1,), nproc_per_node=2)
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, cast

from multigpu.devices import device_type_names, get_device_type
from multigpu.errors import ConfigError, LaunchError
from multigpu.strategies import STRATEGIES

LOOPBACK = "127.0.0.1"
_GRACE_S = 5.0  # how long the other ranks get to exit after one failed, before SIGKILL


def launch_function(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    nproc_per_node: int = 2,
    strategy: str = "ddp",
    env: Mapping[str, str] | None = None,
) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``nproc_per_node`` child processes forming one world; return rank 0's result.

    Args:
        fn: the function every rank runs (it may create ``Session(strategy="ddp")``).
        args: its positional arguments (the same on every rank).
        kwargs: its keyword arguments.
        nproc_per_node: how many processes (ranks), one per device on GPUs.
        strategy: ``ddp`` or ``fsdp``: what ``Session(strategy="auto")`` inside ``fn`` picks.
        env: more environment variables for the children.

    Returns:
        What ``fn`` returned on rank 0, its tensors moved to the CPU (so CUDA stays uninitialised here
        and the next call can fork). ``sys.exit(0)`` in ``fn`` ends that rank cleanly.

    Raises:
        LaunchError: a rank raised (its rank and traceback in the message) or died, or the
            caller cannot fork children that work (CUDA initialised here, no fork).
        ConfigError: a bad count or strategy.

    Example:
        >>> launch_function(lambda: 1 + 1, nproc_per_node=2)  # doctest: +SKIP
        2
    """
    _check(nproc_per_node, strategy)
    from torch.distributed import TCPStore  # the caller hosts the store; every rank is its client

    store = TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False)
    variables = {
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(nproc_per_node),
        "LOCAL_WORLD_SIZE": str(nproc_per_node),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # rank 0 connects to this store instead of hosting one
        "MULTIGPU_STRATEGY": strategy,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc_per_node)),
        **(env or {}),
    }
    context = multiprocessing.get_context("fork")
    children: list[tuple[Any, Connection]] = []
    try:
        for rank in range(nproc_per_node):
            receive, send = context.Pipe(duplex=False)
            child_env = {**variables, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            process = context.Process(
                target=_child, args=(fn, tuple(args), dict(kwargs or {}), child_env, send), name=f"rank-{rank}"
            )
            process.start()
            send.close()  # the child holds the sending end: EOF here when it exits
            children.append((process, receive))
        return _collect(children)
    finally:
        _end_all(children)
        del store


def _check(nproc_per_node: int, strategy: str) -> None:
    if not isinstance(nproc_per_node, int) or isinstance(nproc_per_node, bool) or nproc_per_node < 1:
        raise ConfigError(f"nproc_per_node={nproc_per_node!r}: pass a process count >= 1, e.g. nproc_per_node=2")
    if strategy not in STRATEGIES or not STRATEGIES[strategy].needs_processes:
        names = [name for name, cls in STRATEGIES.items() if cls.needs_processes]
        raise ConfigError(
            f"strategy={strategy!r}: launch_function starts one process per device, for {names}; "
            "for single or dp call the function directly"
        )
    if "fork" not in multiprocessing.get_all_start_methods():
        raise LaunchError(
            "launch_function forks the calling process, which this platform cannot do; put the code in a .py file "
            "and run 'multigpu launch --strategy ddp script.py'"
        )
    started = [name for name in device_type_names() if name != "cpu" and get_device_type(name).is_initialized()]
    if started:
        raise LaunchError(
            f"{started[0]} is already initialised in this process, and forked children cannot use it; restart the "
            f"kernel (or interpreter) and call launch_function before anything touches {started[0]} (no model or "
            "tensor on the GPU in the caller)"
        )


def _child(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], env: dict[str, str], send: Connection
) -> None:
    """One rank: its own process group (so the caller can kill all it starts), the launcher's variables, ``fn``."""
    os.setsid()
    os.environ.update(env)
    rank = int(env["RANK"])
    try:
        try:
            result = fn(*args, **kwargs)
        except SystemExit as done:  # sys.exit(0) (or None) on a rank is a clean end, as in a script
            if done.code not in (0, None):
                raise
            result = None
        # on the CPU: a CUDA tensor unpickled in the caller would initialise CUDA there, and the next
        # launch_function (a fork) would then be refused
        from multigpu.core.structure import map_leaves  # here: importing the launcher stays torch-free

        send.send(("ok", pickle.dumps(map_leaves(_to_cpu, result) if rank == 0 else None)))
    except BaseException as exc:
        try:
            original: bytes | None = pickle.dumps(exc)
        except Exception:  # an exception that does not pickle still reports its text and traceback
            original = None
        send.send(("error", (type(exc).__name__, str(exc), traceback.format_exc(), original)))
    finally:
        send.close()


def _to_cpu(leaf: Any, _: str) -> Any:
    import torch

    return leaf.cpu() if isinstance(leaf, torch.Tensor) else leaf


def _collect(children: list[tuple[Any, Connection]]) -> Any:
    """Wait for every rank; rank 0's result, or a LaunchError for the first rank that failed."""
    pending: dict[Connection, int] = {receive: rank for rank, (_, receive) in enumerate(children)}
    result: Any = None
    while pending:
        for ready in wait(list(pending)):
            receive = cast(Connection, ready)
            rank = pending.pop(receive)
            try:
                kind, payload = receive.recv()
            except EOFError:  # it died without a word (killed, or os._exit)
                process = children[rank][0]
                process.join(timeout=5)
                raise LaunchError(
                    f"rank {rank} of {len(children)} exited with code {process.exitcode} before returning; "
                    "the other ranks were stopped"
                ) from None
            if kind == "error":
                name, text, trace, original = payload
                error = LaunchError(f"rank {rank} of {len(children)} raised {name}: {text}\n\n{trace}")
                cause = _unpickle(original)
                if cause is not None:
                    raise error from cause
                raise error
            if rank == 0:
                result = pickle.loads(payload)
    return result


def _unpickle(data: bytes | None) -> BaseException | None:
    if data is None:
        return None
    try:
        found = pickle.loads(data)
    except Exception:
        return None
    return found if isinstance(found, BaseException) else None


def _end_all(children: list[tuple[Any, Connection]]) -> None:
    """Stop every child still running (SIGTERM, then SIGKILL after the grace), then kill what each started."""
    for process, _ in children:
        if process.exitcode is None:
            _signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for process, receive in children:
        # the sentinel turns ready when the child exits, before it is reaped: its pid, the id of its process
        # group, cannot be reused yet, so the SIGKILL reaches only what it left (e.g. DataLoader workers)
        if not wait([process.sentinel], timeout=max(0.0, deadline - time.monotonic())):
            _signal_group(process.pid, signal.SIGKILL)
        _signal_group(process.pid, signal.SIGKILL)
        process.join()
        receive.close()


def _signal_group(pid: int | None, signum: int) -> None:
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)
