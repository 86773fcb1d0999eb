"""``"wandb"``: a Weights & Biases run, offline by default (``pip install 'multigpu[wandb]'``).

``wandb.init`` gets ``project="multigpu"``, ``mode="offline"`` and the run's name, then
``tracker_options={"wandb": {...}}`` (e.g. ``{"mode": "online", "entity": "team"}``). Offline, each
process writes ``wandb/offline-run-<time>-<id>/`` under ``dir`` (default: the working directory);
``wandb sync wandb/offline-run-*`` uploads them, and ``wandb leet`` views them without a server. The
run's id is multigpu's run id; a resumed run calls ``wandb.init(id=..., resume="allow")``, so every
folder is the same run. A crash loses what W&B had not yet written to its file; after a crash-resume
the resumed run's folder holds the steps after the checkpoint again (once each).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from multigpu.session.trackers.base import RunInfo, Tracker


class WandbTracker(Tracker):
    name = "wandb"
    modules = ("wandb",)
    extra = "wandb"
    refused_options = ("id", "resume", "name")

    def __init__(self, run: Any) -> None:
        self._run = run

    @classmethod
    def open(cls, run: RunInfo) -> WandbTracker:
        import wandb

        resumed = run.resumed or {}
        options = {"project": resumed.get("project", "multigpu"), "mode": "offline", **run.options}
        run_id = resumed.get("id") or run.run_id
        return cls(wandb.init(id=run_id, resume="allow", name=run.name, **options))

    def log(self, values: Mapping[str, float], step: int) -> None:
        self._run.log(dict(values), step=step)

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._run.config.update(dict(hparams), allow_val_change=True)

    def state(self) -> dict[str, Any]:
        return {"id": self._run.id, "project": self._run.project}

    def close(self, *, failed: bool = False) -> None:
        self._run.finish(exit_code=1 if failed else 0)
