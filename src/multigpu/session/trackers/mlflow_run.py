"""``"mlflow"``: an MLflow run through its client, in a local store (``pip install 'multigpu[mlflow]'``).

The store is ``tracker_options={"mlflow": {"tracking_uri": ...}}``, else MLflow's own choice (its
``MLFLOW_TRACKING_URI``, else the SQLite database ``mlflow.db`` in the working directory); view it with
``mlflow ui --backend-store-uri sqlite:///mlflow.db``. The run is in the experiment ``"experiment"``
(default ``"multigpu"``) and tagged ``multigpu.run_id``. Its identity is MLflow's run id and the store's
URI: a resumed run logs into the same run. Without a checkpoint's identity, the experiment's run tagged with
this run's id (made from the launch's run token) is continued when there is one: a restarted main process
logs into it. MLflow's metric history is append-only: steps after the checkpoint that a crashed run had
logged are there twice, the resumed run's value last.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from multigpu.errors import ConfigError
from multigpu.session.trackers.base import RunInfo, Tracker

_RUN_TAG = "multigpu.run_id"


class MlflowTracker(Tracker):
    name = "mlflow"
    modules = ("mlflow", "sqlalchemy", "alembic")
    extra = "mlflow"
    allowed_options = ("tracking_uri", "experiment", "tags")

    def __init__(self, client: Any, run_id: str) -> None:
        self._client = client
        self.run_id = run_id

    @classmethod
    def open(cls, run: RunInfo) -> MlflowTracker:
        from mlflow import MlflowClient

        resumed = run.resumed or {}
        options = dict(run.options)
        uri = options.pop("tracking_uri", None) or resumed.get("tracking_uri")
        client = MlflowClient(tracking_uri=uri)
        if resumed.get("run_id"):
            _check_found(client, resumed["run_id"])
            client.update_run(resumed["run_id"], status="RUNNING")  # it may have ended FINISHED or KILLED
            return cls(client, resumed["run_id"])
        name = options.pop("experiment", "multigpu")
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(name)
        # the run this id already has (a restarted main process of the same launch); run_id is 32 hex digits
        found = client.search_runs([experiment_id], f"tags.`{_RUN_TAG}` = '{run.run_id}'", max_results=1)
        if found:
            client.update_run(found[0].info.run_id, status="RUNNING")  # the killed process left it RUNNING, or
            return cls(client, found[0].info.run_id)  # a finished relaunch FINISHED
        tags = {**options.pop("tags", {}), _RUN_TAG: run.run_id}  # a tag of the user's must not hide the run
        created = client.create_run(experiment_id, run_name=run.name, tags=tags)
        return cls(client, created.info.run_id)

    def log(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        self._client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in hparams.items()])

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self._client.tracking_uri}

    def close(self, *, failed: bool = False) -> None:
        self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _check_found(client: Any, run_id: str) -> None:
    """Refuse a saved run the store does not hold (the checkpoint came from another machine, the store was removed).

    Raises:
        ConfigError: naming the run, the store and the fix.
    """
    from mlflow.exceptions import MlflowException

    try:
        client.get_run(run_id)
    except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        raise ConfigError(
            f"the resumed run's MLflow run {run_id} is not in the tracking store {client.tracking_uri!r}; pass the "
            "store that holds it (tracker_options={'mlflow': {'tracking_uri': ...}}), or drop 'mlflow' from "
            "Session(trackers=...) for this run"
        ) from None
