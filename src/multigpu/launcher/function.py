"""Run a function on several processes from a notebook or any script: :func:`launch_function`.

``multigpu launch`` starts a ``.py`` file; a function typed in a notebook cell, or in a script read
from stdin, has no file to start. :func:`launch_function` forks ``nproc_per_node`` children from
the calling process (fork copies the function, whatever defined it), gives each the variables a
launcher would (``RANK``, ``WORLD_SIZE``, ...), so ``Session(strategy="ddp")`` inside the function
joins one process group, and waits. The caller is no rank: it holds the rendezvous store (bound on
port 0, so no port is raced for) and collects the results.

- rank 0's return value is returned (it must pickle, and unpickle here); the others' are dropped;
- an exception on any rank ends the other ranks and is raised in the caller as a
  :class:`~multigpu.errors.LaunchError` naming the rank, with its traceback (the original
  exception is chained when it pickles);
- ``timeout=`` seconds bounds the whole call: ranks still running then are stopped and a
  :class:`~multigpu.errors.LaunchTimeoutError` names them;
- no child survives: each runs in a session of its own whose processes are killed on the way out
  (DataLoader workers and other helpers included), on success, failure, timeout, or Ctrl-C in the
  caller (:mod:`multigpu.launcher._forked_ranks`);
- calling it again starts fresh children and a fresh store.

Where it cannot work it says so: CUDA already initialised in the caller (a forked child cannot use
it: restart the kernel and call ``launch_function`` before anything touches the GPU), or a
platform without fork.

Example (a notebook cell)::

    def train(lr):
        with multigpu.Session(strategy="ddp") as session:
            ...
            return final_loss

    loss = multigpu.launch_function(train, args=(0.1,), nproc_per_node=2, timeout=3600)
"""

from __future__ import annotations

import math
import multiprocessing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from multigpu.core.limits import to_float
from multigpu.core.lookup import lookup
from multigpu.devices import device_type_names, get_device_type
from multigpu.errors import ConfigError, LaunchError
from multigpu.launcher._forked_ranks import run_ranks
from multigpu.launcher.config import LaunchConfig
from multigpu.launcher.environment import users_run_token, worker_env
from multigpu.launcher.preflight import check_process_count
from multigpu.runtime.worker_env import WorkerRank, owned_variable
from multigpu.strategies import STRATEGIES

LOOPBACK = "127.0.0.1"


def launch_function(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    nproc_per_node: int = 2,
    strategy: str = "ddp",
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``nproc_per_node`` child processes forming one world; return rank 0's result.

    Args:
        fn: the function every rank runs (it may create ``Session(strategy="ddp")``).
        args: its positional arguments (the same on every rank): a tuple or list.
        kwargs: its keyword arguments.
        nproc_per_node: how many processes (ranks), one per device on GPUs; at most 4 per CPU core of
            this machine (and at least 8 allowed), since every rank is forked here.
        strategy: ``ddp`` or ``fsdp``: what ``Session(strategy="auto")`` inside ``fn`` picks.
        env: more environment variables for the children (strings); the ones the launch sets itself
            (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ``MULTIGPU_*``: :func:`~multigpu.runtime.worker_env.owned_variable`)
            are refused.
        timeout: seconds the whole call may take (keyword-only; None, the default: no limit). Ranks
            still running then get SIGTERM, 5 s later SIGKILL, and :class:`~multigpu.errors.LaunchTimeoutError`
            names them.

    Returns:
        What ``fn`` returned on rank 0, its tensors moved to the CPU (so CUDA stays uninitialised here
        and the next call can fork). ``sys.exit(0)`` in ``fn`` ends that rank cleanly.

    Raises:
        LaunchError: a rank raised (its rank and traceback in the message) or died, or the
            caller cannot fork children that work (CUDA initialised here, no fork).
        LaunchTimeoutError: ``timeout`` passed with ranks still running (named).
        ResultError: rank 0's result does not pickle there or does not unpickle here (a class this
            process cannot import).
        ConfigError: a bad count, strategy, argument, environment or timeout.

    Example:
        >>> launch_function(lambda: 1 + 1, nproc_per_node=2, timeout=300)  # doctest: +SKIP
        2
    """
    call_args, call_kwargs = _check_call(fn, args, kwargs)
    _check(nproc_per_node, strategy)
    extra = _check_env(env)
    _check_timeout(timeout)
    from torch.distributed import TCPStore  # the caller hosts the store; every rank is its client

    store = TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False)
    # what multigpu launch tells its workers (the strategy's own launch_env included), but no core binding
    # or stderr copy: the ranks run a function, not the launcher's entry script
    config = LaunchConfig(strategy=strategy, nproc_per_node=nproc_per_node, extra_env=extra)
    shared = worker_env(config, strategy, nproc_per_node, entry=False, run_token=users_run_token())
    try:
        envs = [
            {
                **shared,
                **WorkerRank(
                    rank=rank,
                    local_rank=rank,
                    world_size=nproc_per_node,
                    local_world_size=nproc_per_node,
                    master_addr=LOOPBACK,
                    master_port=store.port,
                    agent_store=True,  # rank 0 connects to this store instead of hosting one
                ).to_environ(),
            }
            for rank in range(nproc_per_node)
        ]
        return run_ranks(fn, call_args, call_kwargs, envs, timeout=timeout)
    finally:
        del store


def _check_call(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if not callable(fn):
        raise ConfigError(f"fn={fn!r} is not callable; pass the function itself, e.g. launch_function(train)")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise ConfigError(
            f"args={args!r}: pass the positional arguments as a tuple or list, e.g. args=(0.1,) (not args=(0.1))"
        )
    if kwargs is not None and (not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs)):
        raise ConfigError(f"kwargs={kwargs!r}: pass a dict of argument names to values, e.g. kwargs={{'lr': 0.1}}")
    return tuple(args), dict(kwargs or {})


def _check(nproc_per_node: int, strategy: str) -> None:
    if not isinstance(nproc_per_node, int) or isinstance(nproc_per_node, bool) or nproc_per_node < 1:
        raise ConfigError(f"nproc_per_node={nproc_per_node!r}: pass a process count >= 1, e.g. nproc_per_node=2")
    check_process_count(nproc_per_node, "nproc_per_node=", fix="use multigpu launch across several nodes")
    lookup(
        {name: cls for name, cls in STRATEGIES.items() if cls.needs_processes},
        strategy if isinstance(strategy, str) else object(),  # anything but a string is no name
        "strategy={value!r}: launch_function starts one process per device, for {choices}; "
        "for single or dp call the function directly",
        shown=strategy,
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


def _check_env(env: Mapping[str, str] | None) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise ConfigError(f"env={env!r}: pass a dict of variable names to strings, e.g. env={{'NCCL_DEBUG': 'INFO'}}")
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise ConfigError(f"env key {key!r} is not a variable name; pass names such as 'NCCL_DEBUG'")
        if not isinstance(value, str) or "\0" in value:
            raise ConfigError(f"env[{key!r}]={value!r}: variable values are strings, e.g. env={{{key!r}: '1'}}")
    owned = sorted(key for key in env if owned_variable(key))
    if owned:
        raise ConfigError(
            f"env sets {', '.join(f'{k}={env[k]!r}' for k in owned)}, which launch_function sets itself for every "
            "rank (the world's size and rendezvous); remove it: the number of ranks is nproc_per_node=, the "
            "strategy strategy="
        )
    return dict(env)


def _check_timeout(timeout: float | None) -> None:
    if timeout is None:
        return
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(to_float(timeout))
        or timeout <= 0
    ):
        raise ConfigError(
            f"timeout={timeout!r}: pass the seconds the call may take, a finite number > 0 (e.g. timeout=3600), "
            "or None for no limit"
        )
