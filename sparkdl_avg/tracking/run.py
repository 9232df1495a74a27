"""The fit's MLflow run: created at the start of `fit`, FINISHED or FAILED on every path.

Only the driver logs. Metrics are queued and written in batches by a background thread, so
a slow tracking server (about 60 ms per REST call) never slows a round down.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import queue
import threading
import time
import traceback
from typing import Any

import numpy as np

log = logging.getLogger("sparkdl_avg")
_FLUSH_EVERY_S = 1.0
_MAX_BATCH = 1000


_PARENT = threading.local()


@contextlib.contextmanager
def parent_run(run_id: str | None):
    """Fits started in this block, on this thread, become children of `run_id` (as of an
    active run). MLflow's active run is per thread, so a fit on a pool thread (CrossValidator
    fits its folds there) would not see the caller's."""
    previous = getattr(_PARENT, "run_id", None)
    _PARENT.run_id = run_id
    try:
        yield
    finally:
        _PARENT.run_id = previous


class RunLogger:
    """Owns one MLflow run. Use as a context manager; the run ends when the block does."""

    def __init__(self, *, experiment_name: str | None, run_name: str | None,
                 tags: dict[str, str]) -> None:
        self._experiment_name = experiment_name
        self._run_name = run_name
        self._tags = tags
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.run_id: str = ""
        self.tracking_uri: str = ""
        self._system_metrics = None

    def __enter__(self) -> RunLogger:
        import mlflow
        from mlflow.tracking import MlflowClient

        # MLflow's own default store resolves to an absolute path; MLFLOW_TRACKING_URI wins.
        self.tracking_uri = mlflow.get_tracking_uri()
        self._client = MlflowClient(self.tracking_uri)
        tags = dict(self._tags)
        given = getattr(_PARENT, "run_id", None)
        active = self._client.get_run(given).info if given else \
            (mlflow.active_run().info if mlflow.active_run() else None)
        if self._experiment_name is not None:
            experiment = mlflow.set_experiment(self._experiment_name)
            experiment_id = experiment.experiment_id
        elif active is not None:
            experiment_id = active.experiment_id
        else:
            from mlflow.tracking.fluent import _get_experiment_id

            experiment_id = _get_experiment_id()
        if active is not None and active.experiment_id == experiment_id:
            tags["mlflow.parentRunId"] = active.run_id
        from mlflow.tracking.context.registry import resolve_tags

        # the source (job script or notebook), user and git commit, as mlflow.start_run sets
        tags = resolve_tags(tags)
        run = self._client.create_run(experiment_id, run_name=self._run_name, tags=tags)
        self.run_id = run.info.run_id
        try:
            self._system_metrics = _start_system_metrics(self.run_id, self.tracking_uri)
        except Exception:  # noqa: BLE001 - a monitor must not cost the run its ending
            log.warning("could not start MLflow system metrics", exc_info=True)
        self._thread = threading.Thread(target=self._flush_loop, name="sparkdl-avg-mlflow",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._system_metrics is not None:
            try:
                self._system_metrics.finish()
            except Exception:  # noqa: BLE001 - never hide the fit's outcome
                log.warning("could not stop system metrics logging", exc_info=True)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        status = "FINISHED" if exc is None else "FAILED"
        try:
            self._flush()
            if exc is not None:
                self._client.set_tag(self.run_id, "error", f"{exc_type.__name__}: {exc}"[:4900])
                self._client.log_text(self.run_id, "".join(traceback.format_exception(exc)),
                                      "error.txt")
        except Exception:  # never hide the fit's own error behind a logging error
            if exc is None:
                raise
            log.warning("could not record the failure in MLflow", exc_info=True)
        finally:
            self._client.set_terminated(self.run_id, status)

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for start in range(0, len(items), 100):
            self._client.log_batch(self.run_id, params=items[start:start + 100])

    def log_inputs(self, datasets: list) -> None:
        self._client.log_inputs(self.run_id, datasets=datasets)

    def set_tags(self, tags: dict[str, Any]) -> None:
        for key, value in tags.items():
            self._client.set_tag(self.run_id, key, str(value)[:4900])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        for key, value in metrics.items():
            self._queue.put(Metric(key, float(value), now, step))

    def log_dict(self, data: dict, artifact_file: str) -> None:
        self._client.log_dict(self.run_id, data, artifact_file)

    def log_dict_quietly(self, data: dict, artifact_file: str) -> None:
        """For supporting material (a timeline): a failure is a warning, not a failed fit."""
        try:
            self.log_dict(data, artifact_file)
        except Exception:  # noqa: BLE001
            log.warning("could not log %s", artifact_file, exc_info=True)

    def log_figure(self, make_figure, artifact_file: str) -> None:
        """Log the figure `make_figure()` draws. A picture that fails is a warning, not a
        failed fit: the training it shows is done."""
        try:
            self._client.log_figure(self.run_id, make_figure(), artifact_file)
        except Exception:  # noqa: BLE001
            log.warning("could not log %s", artifact_file, exc_info=True)

    def log_model(self, model, input_example, registered_model_name: str | None = None) -> None:
        """The model (and, named, a new registered version of it, ready before this
        returns)."""
        import mlflow
        import torch

        if input_example.dtype not in (np.float32, np.float64):  # numpy has no bfloat16
            model = copy.deepcopy(model).float()
            input_example = input_example.astype(np.float32)
        # Explicit requirements: MLflow's inference imports the model in a subprocess (~9 s).
        requirements = [f"torch=={torch.__version__.split('+')[0]}",
                        f"mlflow=={mlflow.__version__}"]
        with mlflow.start_run(run_id=self.run_id, nested=True):
            mlflow.pytorch.log_model(model, name="model", input_example=input_example,
                                     pip_requirements=requirements,
                                     registered_model_name=registered_model_name)

    def _flush_loop(self) -> None:
        while not self._stop.wait(_FLUSH_EVERY_S):
            try:
                self._flush()
            except Exception:  # the tracking server being down must not kill training
                log.warning("could not log metrics to MLflow; will retry", exc_info=True)

    def _flush(self) -> None:
        batch = []
        while True:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for start in range(0, len(batch), _MAX_BATCH):
            try:
                self._client.log_batch(self.run_id, metrics=batch[start:start + _MAX_BATCH])
            except Exception:
                for metric in batch[start:]:  # keep them for the next flush
                    self._queue.put(metric)
                raise


def _start_system_metrics(run_id: str, tracking_uri: str):
    """MLflow's system metrics (CPU, memory, disk, network; GPU with pynvml) for the run, as
    `mlflow.start_run` would do, when `mlflow.enable_system_metrics_logging()` (or
    MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING) asks and psutil (the `metrics` extra) is there."""
    import importlib.util

    from mlflow.environment_variables import MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING

    if not MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING.get():
        return None
    if importlib.util.find_spec("psutil") is None:
        log.warning("system metrics logging is enabled but psutil is missing: "
                    "pip install 'sparkdl-avg[metrics]'")
        return None
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, tracking_uri=tracking_uri)
    monitor.start()
    return monitor
