"""``"tensorboard"``: event files in ``<run_dir>`` (``pip install 'multigpu[tensorboard]'``).

View them with ``tensorboard --logdir runs``. A resumed run opens its writer with ``purge_step`` set
to the step after the checkpoint: TensorBoard's readers then hide the events of later steps that a
crashed run had written, so each step shows once, with the resumed run's value. Hyperparameters go
to the HPARAMS tab of the same run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from multigpu.session.trackers.base import RunInfo, Tracker


class TensorBoardTracker(Tracker):
    name = "tensorboard"
    modules = ("tensorboard",)
    extra = "tensorboard"
    refused_options = ("log_dir", "purge_step")  # the run folder, and the rewind of a resumed run

    def __init__(self, writer: Any) -> None:
        self._writer = writer

    @classmethod
    def open(cls, run: RunInfo) -> TensorBoardTracker:
        from torch.utils.tensorboard import SummaryWriter

        purge = None if run.resumed_step is None else run.resumed_step + 1
        return cls(SummaryWriter(log_dir=str(run.folder), purge_step=purge, **run.options))

    def log(self, values: Mapping[str, float], step: int) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        # SummaryWriter.add_hparams would write them into a new sub-run; these go to this run's own file
        plain = {k: ("None" if v is None else v) for k, v in hparams.items()}
        for summary in hparams_summaries(plain, {}):
            self._writer.file_writer.add_summary(summary)
        self._writer.flush()

    def close(self, *, failed: bool = False) -> None:
        self._writer.close()
