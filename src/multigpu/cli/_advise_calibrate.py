"""``multigpu advise`` on this CPU: the machine's cached constants, the model timed, and ``--measure``'s feedback.

The machine's constants (:class:`multigpu.planning.machine.MachineConstants`) are read from
:func:`multigpu.runtime.world.cache_dir`, measured once when there are none (or with
``--recalibrate``) by :func:`multigpu.launcher.machine_probe.probe_machine`; the model itself is timed
every time (:func:`multigpu.planning.cpu_plan.calibrate_cpu`). After ``advise --measure`` has run
the strategies here, :func:`feed_back_measured` solves each one's own constant from its measured
step and writes it to the same file.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from multigpu.planning.hardware import Platform
    from multigpu.planning.machine import FedBack, MachineConstants
    from multigpu.planning.measured import Checked
    from multigpu.planning.workload import Workload


def machine_constants(*, recalibrate: bool = False) -> MachineConstants:
    """This machine's cached constants, measured and cached first when there are none (or ``recalibrate``)."""
    from multigpu.launcher.machine_probe import probe_machine
    from multigpu.planning import machine
    from multigpu.runtime.world import cache_dir

    key = machine.machine_key()
    cached = None if recalibrate else machine.load(cache_dir(), key)
    if cached is not None:
        return cached
    fresh = probe_machine()
    with contextlib.suppress(OSError):  # a read-only home: this plan uses them, the next one measures again
        machine.save(fresh, cache_dir())
    return fresh


def cpu_plan(
    args: argparse.Namespace,
    model: nn.Module,
    inputs: Callable[[int], torch.Tensor],
    batches: dict[str, Any],
    counts: list[int],
) -> tuple[Workload, Platform]:
    """The workload of ``model`` and this CPU as its platform, for the batches and device counts asked
    (``inputs(n)``: a batch of ``n`` samples)."""
    from multigpu.planning.cpu_plan import calibrate_cpu, cpu_batches

    constants = machine_constants(recalibrate=getattr(args, "recalibrate", False))
    return calibrate_cpu(
        model,
        inputs,
        cpu_batches(counts, **batches),
        constants,
        optimizer=args.optimizer,
        name=args.model,
    )


def feed_back_measured(
    w: Workload, plat: Platform, checked: Sequence[Checked], *, load: float | None = None
) -> tuple[FedBack, str]:
    """Solve the measured strategies' constants into this machine's cache, unless refused (``load``: the
    runnable processes per core besides the runs', :func:`multigpu.planning.machine.load_besides`);
    (what was solved and refused, the file written, or why none was: the measurement is reported either way)."""
    from multigpu.errors import ConfigError
    from multigpu.planning import machine
    from multigpu.runtime.world import cache_dir

    constants = machine_constants()  # measured first where none are cached (seconds: before the turn)
    fed = machine.FedBack({}, {})

    def solve(latest: MachineConstants) -> dict[str, float]:
        nonlocal fed  # solved from the cache as the feedback before this one left it
        fed = machine.feed_back(latest, w, plat, checked, load=load)
        return fed.solved

    try:
        _, written = machine.record_feedback(cache_dir(), constants, solve)
    except OSError as exc:
        return fed, f"not written: {exc}; set MULTIGPU_CACHE_DIR to a writable folder"
    except ConfigError as exc:
        return fed, f"not written: {exc}"
    return fed, "not written: nothing to feed back" if written is None else str(written)
