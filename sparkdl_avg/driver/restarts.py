"""The one restart loop both modes share: run an attempt; when a task fails, hangs or
disconnects (a `WorkerLostError`), count it against `max_failures`, wait for the cluster to
have its slots back, and run the next attempt from where the last one can be taken up."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from pyspark.sql import SparkSession

from sparkdl_avg._config import TrainConfig
from sparkdl_avg._errors import TrainingError, WorkerLostError
from sparkdl_avg.driver.cluster import check_cluster
from sparkdl_avg.tracking.run import RunLogger

log = logging.getLogger("sparkdl_avg")
T = TypeVar("T")
_REPLACE_EXECUTOR_S = 120.0
"""How long a restart waits for the cluster to have enough slots again (a lost executor)."""


class Restarts:
    """Task failures against `max_failures`: each one is logged (a warning, the MLflow metric
    `restarts`), and the one past the limit raises a TrainingError naming the task."""

    def __init__(self, spark: SparkSession, config: TrainConfig, run: RunLogger) -> None:
        self._spark, self._config, self._run = spark, config, run
        self.failures: list[dict] = []

    def record(self, exc: WorkerLostError, resume_at: str, *, step: int,
               check_cluster_after: bool = True) -> None:
        """Count a failure (raising past max_failures) and, unless `check_cluster_after` is
        False (the tasks still run: a parameter server restarted under them), wait for the
        cluster to have its slots again."""
        failure = dict(exc.details or {"error": str(exc)}, restart_at=resume_at)
        self.failures.append(failure)
        self._run.log_metrics({"restarts": len(self.failures)}, step=step)
        where = failure["error"]
        if failure.get("partition") is not None:
            where = (f"partition {failure['partition']} on executor {failure.get('executor')} "
                     f"(host {failure.get('host')}): {where}")
        limit = self._config.max_failures
        if len(self.failures) > limit:
            raise TrainingError(f"training failed {len(self.failures)} time(s), more than "
                                f"max_failures={limit}; the last failure: {where}") from exc
        log.warning("restart %d of at most %d, from %s, after a failure: %s",
                    len(self.failures), limit, resume_at, where)
        if check_cluster_after:
            check_cluster(self._spark, self._config, wait_s=_REPLACE_EXECUTOR_S, restart=True)

    def run(self, attempt: Callable[[], T], resume_at: Callable[[WorkerLostError], str],
            step: Callable[[], int]) -> T:
        """`attempt()` until one returns. After each failure: record it (raising past
        max_failures) and go again; `resume_at(exc)` says where the next attempt takes up
        (for the log and `failures`), `step()` the MLflow step to log the restart at."""
        while True:
            try:
                return attempt()
            except WorkerLostError as exc:
                self.record(exc, resume_at(exc), step=step())
