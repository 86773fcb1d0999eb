"""The parent process of a launch: ``multigpu launch`` builds torchrun's arguments, supervises, explains failures.

- :mod:`~multigpu.launcher.config`: :class:`LaunchConfig`, how to start a script, checked when built.
- :mod:`~multigpu.launcher.launch`: :func:`launch` (one process, or torchrun).
- :mod:`~multigpu.launcher.environment`: what every launched worker is told (every launch path builds it there).
- :mod:`~multigpu.launcher.torchrun`: torchrun's argument list and the call into ``torch.distributed.run``.
- :mod:`~multigpu.launcher.preflight`: checks before anything starts (the master address and port).
- :mod:`~multigpu.launcher.supervise`: the one worker of a ``single``/``dp`` launch, never left behind.
- :mod:`~multigpu.launcher.root_cause`: which rank's failure caused the others, and its traceback.
- :mod:`~multigpu.launcher.affinity` and :mod:`~multigpu.launcher._entry`: what each ddp worker
  runs first (its share of the cores, then the script under torch elastic's ``@record``).
- :mod:`~multigpu.launcher.function`: :func:`launch_function`, a function (a notebook's) on forked ranks
  (started, watched and ended by :mod:`~multigpu.launcher._forked_ranks`).
- :mod:`~multigpu.launcher.preemption`: ``--requeue`` of a SLURM job stopped by a pre-emption signal.
- :mod:`~multigpu.launcher.allreduce_probe`: the all-reduce bandwidth probe, launched as ddp is.
- :mod:`~multigpu.launcher.measure`: ``multigpu advise --measure``'s runs, one strategy at a time, within a budget.

Nothing below this package imports it: the workers' side is :mod:`multigpu.runtime`.
"""

from multigpu.launcher.config import LaunchConfig
from multigpu.launcher.function import launch_function
from multigpu.launcher.launch import launch

__all__ = ["LaunchConfig", "launch", "launch_function"]
