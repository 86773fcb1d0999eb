"""Full training state: save every N steps, keep the last few, resume exactly where a run stopped.

    ckpt = multigpu.Checkpointer(folder="runs/a", keep_last=3)
    resumed = ckpt.resume(model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    start = resumed.step if resumed else 0
    for step in range(start, total):
        ...
        ckpt.save(step=step + 1, model=model, optimizer=opt, scheduler=sched, scaler=scaler,
                  epoch=epoch, data_position={"batch": i + 1})

A checkpoint is a folder ``step-00000042/`` holding the model's storage (``model.safetensors``, or
under fsdp each rank's shards through torch.distributed.checkpoint: :mod:`storages`) and ``state.pt``
(optimizer, scheduler, scaler, step, epoch, data position, every rank's random state; plain tensors and
containers only, so it loads weights-only). Saving and resuming follow one protocol
(:mod:`protocol`): the folder appears in one atomic rename (:mod:`atomic`), and resume checks the whole
state before it changes anything (:mod:`validate`).
"""

from __future__ import annotations

import math
import os
import reprlib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Protocol

from torch import nn

from multigpu.checkpoint.atomic import MAX_STEP, STATE_FILE, folder_name, remove_tree
from multigpu.checkpoint.protocol import resume_step, save_step
from multigpu.checkpoint.ranks import (
    BackgroundWrite,
    Staging,
    agreed,
    capture_rng,
    gather_on_main,
    run_on_main,
    side_group,
)
from multigpu.checkpoint.storages import (
    Writes,
    complete_checkpoints,
    find_latest,
    storage_for,
    storage_of,
    written_for,
)
from multigpu.checkpoint.validate import FORMAT_VERSION, TrainingState, walk_plain
from multigpu.errors import CheckpointError, ConfigError
from multigpu.runtime.committed_steps import committed_steps, set_committed_steps
from multigpu.runtime.run_identity import check_identity, resume_identity, with_identity
from multigpu.runtime.world import world_size

__all__ = ["STATE_FILE", "Checkpointer", "Resumed", "Stateful", "find_latest"]


class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()``: optimizers, schedulers, scalers."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


@dataclass(frozen=True, kw_only=True)
class Resumed:
    """Where a resumed run stands: the counters and data position saved with the checkpoint."""

    path: Path  # the checkpoint folder resumed from
    step: int  # optimizer steps taken before the save
    epoch: int
    data_position: dict[str, Any]  # as passed to save (e.g. {"batch": 17})
    extra: dict[str, Any]
    saved_world_size: int


@dataclass(kw_only=True)
class Checkpointer:
    """Saves and resumes full training state in ``folder``, keeping the last ``keep_last`` steps.

    Args:
        folder: where ``step-NNNNNNNN/`` folders go; created on the first save.
        keep_last: how many checkpoints to keep: after a successful save of step N, the oldest
            checkpoints below N are deleted until ``keep_last`` remain up to N. ``None`` keeps all.
            Only complete checkpoints this library wrote are ever deleted.
        lock_timeout_s: how long a save waits for another process saving into the same folder.
        async_save: ``save`` returns once the state is copied into memory and the write (the same
            atomic protocol) goes on in the background; :meth:`wait` blocks until it is on disk, and
            the next ``save``, ``wait`` or ``close`` raises its failure on every rank. The process
            waits for a pending write before it exits. Under fsdp every rank stages its shards
            and writes them on its own thread (see docs/checkpoints.md).

    Used as a context manager, it waits for a pending write on exit (:meth:`close`).
    """

    folder: Path
    keep_last: int | None = 3
    lock_timeout_s: float = 300.0
    async_save: bool = False
    _writer: BackgroundWrite | None = field(default=None, init=False, repr=False, compare=False)
    # Host buffers the next save reuses (ranks.Staging): one for the storage's part, one for state.pt's.
    _staging: tuple[Staging, Staging] | None = field(default=None, init=False, repr=False, compare=False)
    # Who writes the last asynchronous save that wait() has not collected: "main" (rank 0 alone), "every"
    # rank (a collective storage: fsdp's), None. The same on every rank: saves and waits are collective.
    _pending: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        if self.keep_last is not None and (
            not isinstance(self.keep_last, int) or isinstance(self.keep_last, bool) or self.keep_last < 1
        ):
            raise ConfigError(f"keep_last={self.keep_last!r} must be a positive int or None (keep all).")
        timeout = self.lock_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ConfigError(f"lock_timeout_s={timeout!r} must be a positive number of seconds.")
        if not isinstance(self.async_save, bool):
            raise ConfigError(f"async_save={self.async_save!r} must be True or False.")
        if self.async_save:
            self._writer, self._staging = BackgroundWrite(), (Staging(), Staging())

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
        elif self._writer is not None:  # leaving on an error: wait here, without the other ranks
            failure = self._writer.join()
            if failure is not None:  # the error in flight is raised; this one must not vanish
                warnings.warn(f"the background checkpoint write failed too: {failure}", RuntimeWarning, stacklevel=2)

    def wait(self) -> None:
        """Block until the pending background write (``async_save=True``) is on disk; nothing to do otherwise.

        Raises:
            CheckpointError: that write failed (on every rank: under a process group every rank
                must call it); the previous checkpoint is whole and still the latest.
        """
        writer, pending = self._writer, self._pending
        if writer is None or pending is None:
            return

        def collect() -> None:
            failure = writer.join()
            if failure is not None:
                raise failure

        self._pending = None  # collected now, raised or not
        if pending == "every":  # fsdp: each rank joins its own write; all raise if one failed
            agreed(collect, "writing the last checkpoint in the background")
        else:
            run_on_main(collect, "writing the last checkpoint in the background")

    def close(self) -> None:
        """Wait for a pending background write (see :meth:`wait`); the Checkpointer stays usable."""
        self.wait()

    def save(
        self,
        *,
        step: int,
        model: nn.Module,
        optimizer: Stateful | None = None,
        scheduler: Stateful | None = None,
        scaler: Stateful | None = None,
        epoch: int = 0,
        data_position: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        loader: Stateful | None = None,
    ) -> Path:
        """Write the full training state as ``step-<step>/``, atomically, then prune old steps.

        Args:
            step: optimizer steps taken so far (the step to resume at).
            model: wrapped or bare; saved with the bare model's own keys.
            optimizer, scheduler, scaler: saved through their ``state_dict()``.
            epoch: the current epoch.
            data_position: where the data loader stands (ints/strings), e.g. ``{"batch": 17}``.
            extra: anything else made of tensors, numbers, strings, lists and dicts.
            loader: a session's loader (``session.build_loader`` / ``setup_dataloader``): its
                ``state_dict()`` (epoch, batches taken, generator) is saved as ``data_position["loader"]``,
                so ``resume(loader=...)`` continues mid-epoch without bookkeeping of your own.

        Returns:
            The checkpoint folder.

        Raises:
            ConfigError: ``step``/``epoch`` is not an int from 0 to 2**63-1, or ``data_position``/``extra``
                holds something other than tensors, numbers, strings, lists and dicts.
            CheckpointError: the folder could not be written, or another process held its lock
                for ``lock_timeout_s``; previous checkpoints are intact.

        Every rank must call it: the random states of all ranks are gathered, rank 0 writes,
        the others return when the checkpoint is complete. Under fsdp (a model whose parameters
        are DTensors) every rank also writes its own shards, and rank 0 puts the folder in place
        once all have (see :mod:`dcp`). With ``async_save=True`` it first waits for the
        previous save's write (raising its failure on every rank), and returns once the state is
        copied into memory: the model may change at once, the checkpoint is on disk after :meth:`wait`.
        """
        self.wait()
        for what, count in (("step", step), ("epoch", epoch)):
            if not isinstance(count, int) or isinstance(count, bool):
                raise ConfigError(f"{what}={count!r} must be an int (got {type(count).__name__}).")
            if not 0 <= count <= MAX_STEP:
                raise ConfigError(f"{what}={count} must be between 0 and {MAX_STEP}.")
        counters = {"data_position": dict(data_position or {}), "extra": with_identity(extra or {})}  # + the trackers'
        if loader is not None:
            if not callable(getattr(loader, "state_dict", None)):
                raise ConfigError(
                    f"loader= got a {type(loader).__name__} without state_dict(); pass a session loader "
                    "(session.setup_dataloader(loader) or session.build_loader(...)), or save data_position yourself"
                )
            if _LOADER_KEY in counters["data_position"]:
                raise ConfigError(
                    f"data_position has the key {_LOADER_KEY!r}, which loader= fills; rename your key or drop loader="
                )
            counters["data_position"][_LOADER_KEY] = loader.state_dict()
        for name, value in counters.items():
            for key in value:
                if not isinstance(key, str):
                    raise ConfigError(f"{name} has the key {key!r}; its keys must be strings.")
            walk_plain(value, name, _refuse_at_save, device=None)  # torch.save moves nothing; load maps to CPU
        rngs = gather_on_main(capture_rng(), "random states")
        global_step = committed_steps()  # now: the entries may be written in the background
        target = self.folder / folder_name(step)

        def entries() -> dict[str, Any]:  # state.pt, less the optimizer
            return {
                "format_version": FORMAT_VERSION,
                "step": step,
                "epoch": epoch,
                # the ranks that took part in this save (the gathered list exists on the main process only)
                "world_size": len(rngs) if rngs is not None else world_size(),
                "rng": rngs,
                "scheduler": None if scheduler is None else scheduler.state_dict(),
                "scaler": None if scaler is None else scaler.state_dict(),
                "global_step": global_step,  # session.global_step, which resume puts back
                **counters,
            }

        storage = storage_for(model)(model, optimizer)  # fsdp's: every rank writes its own shards (dcp.py)

        def write(writes: Writes, state: dict[str, Any]) -> None:
            save_step(self.folder, target, writes, state, lock_timeout_s=self.lock_timeout_s, prune=self._prune)

        if self._writer is not None and self._staging is not None:
            writer, (staging, state_staging) = self._writer, self._staging
            group = side_group() if storage.collective else None  # the first time: a collective, every rank is here

            def stage() -> tuple[Writes, dict[str, Any]]:  # the state into memory now
                return storage.staged(staging), state_staging.copy(entries())

            def start(snapshot: tuple[Writes, dict[str, Any]]) -> None:  # then written in the background
                staged, state = snapshot
                writer.start(lambda: write(staged, state), target.name, group=group)

            if storage.collective:  # every rank stages its part (all raise if one failed), then writes it
                start(agreed(stage, f"copying checkpoint {target} into memory"))
            else:  # the main process alone
                run_on_main(lambda: start(stage()), f"copying checkpoint {target} into memory")
            self._pending = "every" if storage.collective else "main"
        elif storage.collective:
            write(storage, entries())
        else:  # the main process writes, the others wait for it
            run_on_main(lambda: write(storage, entries()), f"saving checkpoint {target}")
        return target

    def resume(
        self,
        *,
        model: nn.Module,
        optimizer: Stateful | None = None,
        scheduler: Stateful | None = None,
        scaler: Stateful | None = None,
        path: str | os.PathLike[str] | None = None,
        allow_unsafe_pickle: bool = False,
        loader: Stateful | None = None,
    ) -> Resumed | None:
        """Load the latest checkpoint (or ``path``) into the given objects and this rank's RNG.

        All or nothing: the whole checkpoint (weights, optimizer, scheduler, scaler, random states,
        counters) is checked against the given objects before any of them changes.

        Returns:
            What was resumed, or ``None`` when the folder holds no checkpoint yet. ``loader`` (saved
            with ``save(loader=...)``) is put back last: its next iteration continues the saved epoch.

        Raises:
            CheckpointError: the checkpoint is damaged or does not fit the given objects; the
                message names the file, the entry and what was expected; nothing was changed.

        Any rank may call it and every rank should: each reads the files and takes its own
        random state. Resuming at another world size loads everything except the random state
        of ranks that did not exist before (a warning says so: the run then differs from the
        uninterrupted one). A sharded checkpoint (saved under fsdp) is read with
        torch.distributed.checkpoint: under a process group every rank must call it (the ranks
        check the folder and read it together); without one, one process reads it whole. After
        an asynchronous save that :meth:`wait` has not collected, every rank must call it: each
        waits for the write first (under DDP for rank 0's).
        """
        if self._writer is not None:  # the pending write first; its failure is raised by the next save/wait/close
            if self._pending == "main":  # rank 0's: every rank waits for it (else a rank reads the step before)
                run_on_main(self._writer.finish, "writing the last checkpoint in the background")
            else:
                self._writer.finish()
        locate = (lambda: Path(path)) if path is not None else self.latest
        parts = {"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
        first = locate()
        # The storage that holds the folder (a sharded one with files missing too: its index names it),
        # else the one that would save this model; a collective one reads the folder the ranks agreed on.
        kind = (storage_of(first) if first is not None else None) or storage_for(model)
        storage = kind(model, optimizer, folder=first)
        if storage.collective:
            locate = lambda: first  # noqa: E731

        def holds_loader(folder: Path, checked: TrainingState) -> None:
            check_identity(checked.extra, folder / STATE_FILE)  # the Session's tracker runs can continue
            if loader is None:
                return
            if _LOADER_KEY not in checked.data_position:
                raise CheckpointError(
                    f"{str(folder)!r} holds no loader state (it was saved without loader=); nothing was "
                    "loaded: resume without loader= and position the loader yourself (loader.set_epoch, "
                    "skip_first_batches)"
                )
            check = getattr(loader, "check_state_dict", None)  # a session loader checks before anything changes
            if callable(check):
                try:
                    check(checked.data_position[_LOADER_KEY])
                except ConfigError as exc:
                    raise CheckpointError(
                        f"{str(folder / STATE_FILE)!r}: entry 'data_position'['loader'] does not fit the loader "
                        f"passed to resume; nothing was loaded. {exc}"
                    ) from exc

        found = resume_step(storage, locate, parts, allow_unsafe_pickle=allow_unsafe_pickle, also_check=holds_loader)
        if found is None:
            return None
        folder, checked = found
        if loader is not None:
            loader.load_state_dict(checked.data_position[_LOADER_KEY])
        if checked.global_step is not None:
            set_committed_steps(checked.global_step)
        extra = resume_identity(checked.extra, checked.step)  # the Session continues the saved tracker runs
        return Resumed(
            path=folder,
            step=checked.step,
            epoch=checked.epoch,
            data_position=checked.data_position,
            extra=extra,
            saved_world_size=checked.world_size,
        )

    def latest(self) -> Path | None:
        """The newest complete checkpoint folder, or ``None``."""
        return find_latest(self.folder)

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints in the folder, oldest first."""
        return [found.step for found in complete_checkpoints(self.folder)]

    def _prune(self, just_written: int) -> None:
        complete = complete_checkpoints(self.folder)
        later = [found.step for found in complete if found.step > just_written]
        if later:
            warnings.warn(
                f"{str(self.folder)!r} holds checkpoints of later steps ({later[:5]}) than the one just "
                f"saved ({just_written}); they are kept, and resume() picks the latest of them. "
                "Give each run its own folder.",
                RuntimeWarning,
                stacklevel=8,  # the caller of Checkpointer.save (one file)
            )
        if self.keep_last is None:
            return
        older = [found for found in complete if found.step < just_written and written_for(found.path, found.step)]
        for found in older[: max(0, len(older) + 1 - self.keep_last)]:
            remove_tree(found.path)


_LOADER_KEY = "loader"  # data_position's entry for save(loader=...)


def _refuse_at_save(where: str, found: Any, expected: str) -> NoReturn:
    shown = found if isinstance(found, str) else f"a {type(found).__name__} ({reprlib.repr(found)})"
    raise ConfigError(
        f"{where} is {shown}; expected {expected}: checkpoints hold only tensors, numbers, strings, "
        "lists and dicts, so they load without unpickling code."
    )
