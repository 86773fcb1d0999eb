"""The environment every launched worker starts with: the one builder all launch paths use.

``multigpu launch`` (:mod:`multigpu.launcher.launch`: torchrun's workers and the one process of
``single``/``dp``), :func:`~multigpu.launcher.function.launch_function`'s forked ranks and
``multigpu advise --measure``'s runs (:mod:`multigpu.launcher.measure`) all call :func:`worker_env`. It
writes what multigpu's runtime reads through :class:`~multigpu.runtime.worker_env.WorkerEnv` (the strategy,
devices, threads, core binding, collective timeout, failure folder, ``--debug``) and adds what the
strategy asks its workers to hold from their start (:meth:`~multigpu.strategies.Strategy.launch_env`; fsdp
on the CPU: glibc's malloc returning freed buffers), the user's extra variables, and torch elastic's
restart setting.

Example:
    >>> from multigpu.launcher.config import LaunchConfig
    >>> WorkerEnv.from_environ(worker_env(LaunchConfig(strategy="ddp"), "ddp", 2)).strategy
    'ddp'
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from multigpu.devices import process_device_type
from multigpu.launcher.config import LaunchConfig, logs_requested
from multigpu.runtime import world
from multigpu.runtime.worker_env import WorkerEnv, new_run_token
from multigpu.runtime.world import configured_threads
from multigpu.strategies import STRATEGIES


def worker_env(
    config: LaunchConfig,
    strategy: str,
    nproc: int,
    *,
    failure_dir: str | None = None,
    entry: bool = True,
    run_token: str | None = None,
) -> dict[str, str]:
    """The variables every worker gets on top of the launcher's own environment.

    Args:
        config: the launch (its devices, threads, core binding, timeout, logs, ``--debug``, extra variables).
        strategy: the strategy the workers run (``auto`` resolved).
        nproc: processes on this node (they share its cores: ``OMP_NUM_THREADS`` = cores / processes unless set).
        failure_dir: the folder where each worker records its failure (ddp and fsdp launches).
        entry: the workers start through :mod:`multigpu.launcher._entry`, which binds cores and copies stderr;
            False for ranks that run a function (launch_function): neither is asked of them.
        run_token: the launch's run token (the same for every worker and every restart of the launch, so the
            trackers continue one run); None: a new one (:func:`~multigpu.runtime.worker_env.new_run_token`).
    """
    threads = config.threads_per_process or configured_threads() or max(1, (os.cpu_count() or 1) // nproc)
    device_type = process_device_type()  # what each worker computes on (runtime.world.process_device)
    bind = config.bind_cores if config.bind_cores is not None else device_type.name == "cpu"
    chosen = STRATEGIES[strategy]
    settings = WorkerEnv(
        strategy=strategy,
        devices=config.devices or None,
        threads=threads,
        bind_cores=entry and bind and chosen.needs_processes,  # threads (dp) need every core
        collective_timeout_s=config.collective_timeout_s,
        failure_dir=failure_dir,
        # the worker copies its stderr for the summary (torchrun's files do it otherwise)
        stderr_copy=entry and not logs_requested(config),
        debug=config.debug,  # the worker turns on torch's checks too (runtime.tracking.setup_worker)
        run_token=run_token or new_run_token(),
    )
    # extra_env holds none of the launch's own variables (LaunchConfig refuses them) but OMP_NUM_THREADS, in
    # any of OpenMP's forms: the user's, as launch_function(env=...) always took it
    env = {**settings.to_environ(), **config.extra_env}
    env.update(chosen.launch_env(device_type, {**os.environ, **env}))
    if config.max_restarts > 0:
        # Restarted gloo workers otherwise may read the previous attempt's addresses from the
        # shared rendezvous store and fail to connect (pytorch/pytorch#135712).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def users_run_token() -> str | None:
    """The run token the user set for this launch (``MULTIGPU_RUN_ID``), or None: the launch makes its own.

    None too in a process that a launch started (every launch sets ``MULTIGPU_STRATEGY``): the token there is
    that outer launch's, and a launch started from it is a run of its own (as :func:`inherited` says).

    Raises:
        LaunchError: ``MULTIGPU_RUN_ID`` is set but not a token, named with its value and the fix.
    """
    token = world.run_token()
    return token if world.requested_strategy() is None else None


def inherited(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` as a launch's workers inherit it: without the settings an outer launch left there.

    A launch started from inside a launched process (a script that runs ``multigpu launch``, or ``advise
    --measure``, in a worker) inherits that worker's ``MULTIGPU_*`` settings; its own workers would record
    their failures in the outer run's folder, or run under its ``--debug``, where this launch sets none.
    """
    stale = WorkerEnv.variables()
    return {name: value for name, value in environ.items() if name not in stale}
