"""``"trackio"``: a trackio run in its local store (``pip install 'multigpu[trackio]'``).

``trackio.init`` gets ``project="multigpu"``, the run's name followed by the first 8 hex digits of multigpu's
run id (``lr-0.1-3fa2b1c9``: trackio finds a run by its name, so two runs must not share one) in the group
named by the run's name, then ``tracker_options={"trackio": {...}}``; without a ``space_id`` it writes
``<project>.db`` in trackio's folder (``TRACKIO_DIR``, else ``~/.cache/huggingface/trackio``) and ``trackio
show`` views it. trackio takes the hyperparameters as the run's config, attached to the first logged values:
call ``session.log_hparams`` before the first ``session.log``. Its identity is the project and that name: a
resumed run calls ``trackio.init(resume="must")`` with them, a new one ``resume="allow"`` (a restarted main
process continues the run of its name). trackio keeps every logged row, so steps after the checkpoint that a
crashed run had logged are there twice, the resumed run's value last.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from multigpu.session.trackers.base import RunInfo, Tracker


class TrackioTracker(Tracker):
    name = "trackio"
    modules = ("trackio",)
    extra = "trackio"
    refused_options = ("name", "resume")

    def __init__(self, run: Any) -> None:
        self._run = run

    @classmethod
    def open(cls, run: RunInfo) -> TrackioTracker:
        import trackio

        resumed = run.resumed or {}
        options = {"project": resumed.get("project", "multigpu"), "group": run.name, **run.options}
        name = resumed.get("name") or f"{run.name}-{run.run_id[:8]}"
        return cls(trackio.init(name=name, resume="must" if resumed else "allow", **options))

    def log(self, values: Mapping[str, float], step: int) -> None:
        self._run.log(dict(values), step=step)

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._run.config.update(hparams)  # sent with the next logged values, if none went before

    def state(self) -> dict[str, Any]:
        return {"project": self._run.project, "name": self._run.name}

    def close(self, *, failed: bool = False) -> None:
        self._run.finish()
