"""How a :class:`multigpu.session.Session` trains: one keyword-only dataclass, validated when built.

Every field is checked for its type and range in ``__post_init__``, so a wrong value fails where
it is written, with a :class:`~multigpu.errors.ConfigError` that shows the value and the fix,
instead of a raw ``TypeError`` deep inside a step (or, worse, a silently wrong step: a float
``accumulate=1.5`` would step on 4/3 of the mean gradient).

Example:
    >>> SessionConfig(strategy="single", accumulate=2).accumulate
    2
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multigpu.core.limits import to_float
from multigpu.core.lookup import lookup
from multigpu.devices import DeviceSpec
from multigpu.errors import ConfigError
from multigpu.session.trackers import check_trackers, default_trackers
from multigpu.strategies import PRECISIONS, STRATEGIES, DDPOptions, FSDPOptions
from multigpu.strategies.activation_checkpointing import CheckpointChoice, normalize_choice

_MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes up to 64 bits; the loader adds the epoch


@dataclass(frozen=True, kw_only=True)
class SessionConfig:
    """How a :class:`~multigpu.session.Session` trains.

    Attributes:
        strategy: ``single``, ``dp``, ``ddp``, ``fsdp`` or ``auto`` (see :mod:`multigpu.strategies`).
        precision: ``fp32``, ``bf16`` (autocast) or ``fp16`` (autocast and a gradient scaler).
        accumulate: micro-steps per optimizer step (gradient accumulation; 1 = none); an integer.
        devices: the devices of ``single`` / ``dp`` (``"cpu:2"``, ``"cuda:0,1"``); None: defaults.
        seed: seeds torch when the session starts (same on every rank) and the loader's shuffle;
            an integer in ``[0, 2**63 - 1]``.
        timeout_s: how long a collective waits for a missing rank before failing (ddp); None:
            ``multigpu launch --collective-timeout`` if given, else 600 s.
        run_dir: the folder :meth:`~multigpu.session.Session.log` writes ``metrics.csv`` (and
            TensorBoard events) into; None: ``runs/<run token>`` under ``multigpu launch`` (``MULTIGPU_RUN_ID``),
            else ``runs/<start time>-<strategy>``, under the working directory, created on the first ``log``
            (a run ``Checkpointer.resume`` continues keeps its first folder).
        trackers: where ``log`` and ``log_hparams`` go, by name: ``"csv"``, ``"tensorboard"``, ``"mlflow"``,
            ``"wandb"``, ``"aim"``, ``"trackio"`` (:mod:`multigpu.session.trackers`; each but the CSV needs
            its extra, e.g. ``pip install 'multigpu[mlflow]'``); None: the CSV, and TensorBoard when installed.
        run_name: the run's name in every tracker; None: the run folder's name.
        tracker_options: keywords for each tracker's library, by tracker name, e.g.
            ``{"wandb": {"project": "digits"}, "mlflow": {"tracking_uri": "sqlite:///runs/mlflow.db"}}``.
        ddp: DDP's knobs under ddp (:class:`multigpu.strategies.ddp.DDPOptions`).
        fsdp: how fsdp shards the model (:class:`multigpu.strategies.fsdp.FSDPOptions`).
        sync_batchnorm: BatchNorm statistics over the global batch under ddp/fsdp (a no-op,
            with a warning, in one process, whose BatchNorm already sees the whole batch).
        compile: ``torch.compile`` the wrapped model (:meth:`multigpu.strategies.Strategy.apply_compile`).
        activation_checkpointing: the module classes (the model's repeated block, e.g. a transformer
            layer) or a predicate ``module -> bool`` whose modules recompute their activations in
            backward instead of storing them (torch's non-reentrant checkpoint; same gradients, dropout
            included); applied before the strategy wraps the model and before ``compile``
            (:mod:`multigpu.strategies.activation_checkpointing`). None: store everything.
        seed_per_rank: with several processes, once ``setup_model`` has built the model (the same
            initial weights everywhere), reseed each rank's torch generator with a seed of its own,
            so ranks draw independent dropout masks as one device does over the global batch
            (Accelerate's ``set_seed(device_specific=True)``). False: every rank draws the same
            stream (the same mask for sample ``j`` of every rank).
        deterministic: the same results run after run (:mod:`multigpu.session.determinism`):
            deterministic algorithms only, cuDNN deterministic and not benchmarking, seeded loader
            workers; slower, and an operation without a deterministic version raises.
        tokens_per_sample: tokens one sample holds (a sequence length), so that ``session.log`` adds
            ``tokens_per_s`` to its samples per second (:mod:`multigpu.session.throughput`); None: no tokens/s.
        debug: check before every collective that all ranks issue the same one (a mismatch raises
            :class:`~multigpu.errors.CollectiveMismatchError` naming each rank's call) and turn on torch's
            checks (``TORCH_DISTRIBUTED_DEBUG``: ``DETAIL`` under NCCL, ``INFO`` under gloo); costs an extra exchange per collective
            (``multigpu launch --debug`` does the same).
    """

    strategy: str = "auto"
    precision: str = "fp32"
    accumulate: int = 1
    devices: DeviceSpec = None
    seed: int = 0
    timeout_s: float | None = None
    run_dir: str | Path | None = None
    trackers: tuple[str, ...] | None = None
    run_name: str | None = None
    tracker_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    ddp: DDPOptions = field(default_factory=DDPOptions)
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    sync_batchnorm: bool = False
    compile: bool = False
    activation_checkpointing: CheckpointChoice | None = None
    seed_per_rank: bool = True
    deterministic: bool = False
    debug: bool = False
    tokens_per_sample: int | None = None

    def __post_init__(self) -> None:
        _check_choice("strategy", self.strategy, ["auto", *STRATEGIES], "strategy='ddp'")
        _check_choice("precision", self.precision, sorted(PRECISIONS), "precision='bf16'")
        if not _is_int(self.accumulate) or self.accumulate < 1:
            raise ConfigError(
                f"accumulate={self.accumulate!r} must be an integer >= 1 (micro-steps per optimizer step; "
                "1 = step after every batch), e.g. accumulate=2"
            )
        if not _is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED:
            raise ConfigError(f"seed={self.seed!r} must be an integer in [0, 2**63 - 1], e.g. seed=0")
        # numpy integers pass as integers; keep plain ints so arithmetic and printing stay Python's
        object.__setattr__(self, "accumulate", int(self.accumulate))
        object.__setattr__(self, "seed", int(self.seed))
        if self.timeout_s is not None and not _is_positive_seconds(self.timeout_s):
            raise ConfigError(
                f"timeout_s={self.timeout_s!r} must be a finite number of seconds > 0, e.g. timeout_s=600 "
                "(or None for the launcher's --collective-timeout, else 600)"
            )
        if self.run_dir is not None and not isinstance(self.run_dir, (str, Path)):
            raise ConfigError(f"run_dir={self.run_dir!r} must be a folder path (str or Path), e.g. run_dir='runs/a'")
        chosen = default_trackers() if self.trackers is None else self.trackers
        checked = check_trackers(chosen, self.tracker_options)
        object.__setattr__(self, "trackers", None if self.trackers is None else checked)
        if self.run_name is not None and (not isinstance(self.run_name, str) or not self.run_name.strip()):
            raise ConfigError(f"run_name={self.run_name!r} must be a non-empty string, e.g. run_name='lr-0.1'")
        for name, kind in _options_fields():
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(
                    f"{name}={getattr(self, name)!r} must be a {kind.__name__}; use e.g. {name}={kind.__name__}()"
                )
        if self.tokens_per_sample is not None and (not _is_int(self.tokens_per_sample) or self.tokens_per_sample < 1):
            raise ConfigError(
                f"tokens_per_sample={self.tokens_per_sample!r} must be an integer >= 1 (the tokens one sample holds, "
                "e.g. the sequence length: tokens_per_sample=1024), or None"
            )
        object.__setattr__(self, "activation_checkpointing", normalize_choice(self.activation_checkpointing))
        for name in ("sync_batchnorm", "compile", "seed_per_rank", "deterministic", "debug"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")

    def strategy_options(self) -> dict[str, Any]:
        """Each strategy's options by its name (``{"ddp": DDPOptions(...), "fsdp": FSDPOptions(...)}``)."""
        return {name: getattr(self, name) for name, _ in _options_fields()}


def _options_fields() -> list[tuple[str, type]]:
    """Each strategy with options: its name (the field holding them) and the options' type."""
    return [(cls.name, cls.options_type) for cls in STRATEGIES.values() if cls.options_type is not None]


def _check_choice(name: str, value: object, choices: list[str], example: str) -> None:
    key = value if isinstance(value, str) else object()  # anything but a string is no name (True == 1 hashes alike)
    message = "{name}={value!r} is not one of {choices}; use e.g. {example}"
    lookup(dict.fromkeys(choices), key, message, choices=choices, shown=value, name=name, example=example)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_positive_seconds(value: object) -> bool:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    return math.isfinite(to_float(value)) and to_float(value) > 0
