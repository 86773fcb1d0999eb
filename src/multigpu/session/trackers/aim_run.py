"""``"aim"``: an Aim run in a local repository (``pip install 'multigpu[aim]'``).

The repository is ``tracker_options={"aim": {"repo": ...}}``, else Aim's default (the working
directory's ``.aim``); ``aim up`` views it. The run is in the experiment ``"experiment"`` (default
``"multigpu"``), named by the run's name, hyperparameters under ``run["hparams"]``. Its identity is
Aim's run hash and the repository: a resumed run reopens it, and so does a restarted main process, from the
run folder's record (Aim's queries read an index that a running or killed run is not in yet). Aim keeps one value per step, so steps
after the checkpoint that a crashed run had logged are replaced by the resumed run's values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from multigpu.errors import ConfigError
from multigpu.session.trackers.base import RunInfo, Tracker


class AimTracker(Tracker):
    name = "aim"
    modules = ("aim",)
    extra = "aim"
    refused_options = ("run_hash",)

    def __init__(self, run: Any) -> None:
        self._run = run

    @classmethod
    def open(cls, run: RunInfo) -> AimTracker:
        from aim import Run

        resumed = run.resumed or {}
        options = {"experiment": "multigpu", **run.options}
        options["repo"] = options.get("repo") or resumed.get("repo")
        if resumed.get("hash"):
            from aim.sdk.errors import MissingRunError

            options.pop("experiment")  # the run keeps the experiment it was created in
            try:
                return cls(Run(run_hash=resumed["hash"], **options))
            except MissingRunError:  # the checkpoint came from another machine, or the repository was removed
                raise ConfigError(
                    f"the resumed run's Aim run {resumed['hash']} is not in the repository {options['repo']!r}; pass "
                    "the repository that holds it (tracker_options={'aim': {'repo': ...}}), or drop 'aim' from "
                    "Session(trackers=...) for this run"
                ) from None
        opened = Run(**options)
        opened.name = run.name
        opened["multigpu_run_id"] = run.run_id
        return cls(opened)

    def log(self, values: Mapping[str, float], step: int) -> None:
        for name, value in values.items():
            self._run.track(value, name=name, step=step)

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        kept = self._run.get("hparams") or {}
        self._run["hparams"] = {**kept, **hparams}

    def state(self) -> dict[str, Any]:
        return {"hash": self._run.hash, "repo": str(self._run.repo.root_path)}

    def close(self, *, failed: bool = False) -> None:
        self._run.close()
