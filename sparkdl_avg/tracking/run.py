"""The fit's MLflow run: created at the start of `fit`, FINISHED or FAILED on every path.

Only the driver logs, and never on the fit's critical path: the run is created on a thread
of its own while the fit checks its input and the cluster (a fresh store takes seconds to
create its tables), and parameters, tags and inputs are written there in order. Metrics are
queued and written in batches by another thread, so a slow tracking server (about 60 ms per
REST call) never slows a round down. `ready()` waits for what is pending and raises what
failed; the fit calls it before training starts.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sparkdl_avg._gc_pause import collector_paused
from sparkdl_avg.tracking import first_use
from sparkdl_avg.tracking.parent import named_parent, parent_run  # noqa: F401 - parent_run was documented here
from sparkdl_avg.tracking.system_metrics import start_system_metrics

log = logging.getLogger("sparkdl_avg")
_FLUSH_EVERY_S = 1.0
_MAX_BATCH = 1000
_PARAM_CHARS, _TAG_CHARS = 6000, 4900
"""The longest param and tag values logged (MLflow refuses a param value over 6,000)."""


def _clipped(kind: str, values: dict[str, Any], limit: int) -> dict[str, str]:
    """`values` as strings of at most `limit` characters, each one cut named in a warning."""
    out = {}
    for key, value in values.items():
        text = str(value)
        if len(text) > limit:
            log.warning("the MLflow %s %r is %d characters long: logged cut to its first %d",
                        kind, key, len(text), limit)
            text = text[:limit]
        out[key] = text
    return out


class RunLogger:
    """Owns one MLflow run. Use as a context manager; the run ends when the block does."""

    def __init__(self, *, experiment_name: str | None, run_name: str | None,
                 tags: dict[str, str], logs_model: bool | str = False) -> None:
        self._logs_model = logs_model
        self._warm: threading.Thread | None = None
        self._ahead = None
        """The model being saved before it trains (`save_model_ahead`)."""
        self._experiment_name = experiment_name
        self._run_name = run_name
        self._tags = tags
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._writes: ThreadPoolExecutor | None = None
        self._opened: Future | None = None
        self._pending: list[Future] = []
        self._run_id = ""
        self._tracking_uri = ""
        self._system_metrics = None

    @property
    def run_id(self) -> str:
        self._wait_open()
        return self._run_id

    @property
    def tracking_uri(self) -> str:
        self._wait_open()
        return self._tracking_uri

    def __enter__(self) -> RunLogger:
        # Read on this thread: the caller's active run and parent are per thread. A process
        # that has not imported mlflow has no active run.
        fluent = sys.modules.get("mlflow")
        active = fluent.active_run() if fluent is not None else None
        parent = named_parent()
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="sparkdl-avg-mlflow-open")
        self._opened = self._writes.submit(self._open, active.info if active else None, parent)
        return self

    def _open(self, active, parent: str | None) -> None:
        with collector_paused():  # a first fit imports MLflow and its store's SQLAlchemy here
            _import_pyspark_ml()
            self._open_run(active, parent)
            import mlflow.types.utils  # noqa: F401 - the fit's datasets need it (`opened`)

    def _open_run(self, active, parent: str | None) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        # MLflow's own default store resolves to an absolute path; MLFLOW_TRACKING_URI wins.
        self._tracking_uri = mlflow.get_tracking_uri()
        self._client = MlflowClient(self._tracking_uri)
        tags = dict(self._tags)
        if parent:
            active = self._client.get_run(parent).info
        if self._experiment_name is not None:
            experiment_id = mlflow.set_experiment(self._experiment_name).experiment_id
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
        self._run_id = run.info.run_id
        try:
            self._system_metrics = start_system_metrics(self._run_id, self._tracking_uri)
        except Exception:  # noqa: BLE001 - a monitor must not cost the run its ending
            log.warning("could not start MLflow system metrics", exc_info=True)
        self._thread = threading.Thread(target=self._flush_loop, name="sparkdl-avg-mlflow",
                                        daemon=True)
        self._thread.start()

    def _wait_open(self) -> None:
        if self._opened is None:
            raise RuntimeError("the MLflow run is used outside its `with` block")
        self._opened.result()

    def _later(self, write: Callable[[], None]) -> None:
        """Write to the run on the MLflow thread, in order, once the run exists."""
        self._pending.append(self._writes.submit(write))

    def warm_up(self) -> None:
        """Start warming up what is logged at the end (`first_use.pay`), once the run is open
        (so one thread at a time imports MLflow). The fit starts it before its first Spark job:
        in a cold session that job waits seconds for the executors' Python to import torch,
        on one core while the other idles, and the warm-up fills that time instead of taking
        CPU from the workers once they train."""
        if self._warm is not None:
            return

        def after_open() -> None:
            if self._opened.exception() is None:  # a run that failed to open fails the fit
                first_use.pay(self._logs_model)

        self._warm = threading.Thread(target=after_open, name="sparkdl-avg-warm-up",
                                      daemon=True)
        self._warm.start()

    def _warmed_up(self) -> None:
        """Wait for the warm-up (`warm_up`), if it started: before drawing or exporting."""
        if self._warm is not None:
            self._warm.join(timeout=120)

    def _background_ended(self) -> None:
        """Wait for the warm-up and the saving ahead (which waits for the warm-up first)."""
        self._warmed_up()
        if self._ahead is not None:
            self._ahead.wait(None)

    def opened(self) -> RunLogger:
        """Wait until the run exists (raising why it could not be created). From then on
        the MLflow modules the fit imports on its own thread are imported: the warm-up,
        which starts then, never imports them beside it (two threads importing one import
        cycle at once can fail in Python's import locks)."""
        self._wait_open()
        return self

    def ready(self) -> RunLogger:
        """Before training: wait for the run and its pending writes (`_drain`); the warm-up
        starts here if the fit has not started it yet."""
        self._drain()
        self.warm_up()
        return self

    def _drain(self) -> None:
        """Wait until the run exists and every write handed to the MLflow thread is done;
        raise the first that failed."""
        self._wait_open()
        pending, self._pending = self._pending, []
        for write in pending:
            write.result()

    def __exit__(self, exc_type, exc, tb) -> None:
        # Nothing the fit started outlives it: the warm-up and the saving ahead (which begins
        # nothing once closed) import modules and set torch.export's process-wide flags, which
        # a failed fit's caller would otherwise meet in its next lines
        if self._ahead is not None:
            self._ahead.close()
        self._background_ended()
        try:
            self._wait_open()
        except Exception:
            self._writes.shutdown(wait=True)
            if exc is None:
                raise
            log.warning("could not create the MLflow run of this failed fit", exc_info=True)
            return
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
            self._drain()  # not ready(): a fit that ends here needs no warm-up
            self._flush()
            if exc is not None:
                self._client.set_tag(self._run_id, "error",
                                     f"{exc_type.__name__}: {exc}"[:4900])
                self._client.log_text(self._run_id,
                                      "".join(traceback.format_exception(exc)), "error.txt")
        except Exception:  # never hide the fit's own error behind a logging error
            if exc is None:
                raise
            log.warning("could not record the failure in MLflow", exc_info=True)
        finally:
            self._writes.shutdown(wait=True)
            self._client.set_terminated(self._run_id, status)

    def log_params(self, params: dict[str, Any]) -> None:
        params = _clipped("param", params, _PARAM_CHARS)

        def write() -> None:
            from mlflow.entities import Param

            items = [Param(k, v) for k, v in params.items()]
            for start in range(0, len(items), 100):
                self._client.log_batch(self._run_id, params=items[start:start + 100])

        self._later(write)

    def log_inputs(self, datasets: list) -> None:
        self._later(lambda: self._client.log_inputs(self._run_id, datasets=datasets))

    def set_tags(self, tags: dict[str, Any]) -> None:
        tags = _clipped("tag", tags, _TAG_CHARS)

        def write() -> None:
            for key, value in tags.items():
                self._client.set_tag(self._run_id, key, value)

        self._later(write)

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
        self._warmed_up()  # it imports matplotlib
        try:
            self._client.log_figure(self.run_id, make_figure(), artifact_file)
        except Exception:  # noqa: BLE001
            log.warning("could not log %s", artifact_file, exc_info=True)

    def save_model_ahead(self, model, *, schema, heads, names=None,
                         preprocess: bytes | None = None, model_schema=None,
                         preprocess_fn=None) -> None:
        """Start saving `model`, before it trains, as `log_model` will save it trained, on a
        thread that follows the warm-up (`tracking/model_ahead`: only the trained values are
        then written)."""
        from sparkdl_avg.tracking.model_ahead import SavedAhead
        from sparkdl_avg.tracking.requirements import model_requirements

        ahead = self._ahead = SavedAhead(
            model, schema=schema, heads=tuple(heads), names=names,
            pip_requirements=model_requirements(preprocess_fn), preprocess=preprocess,
            model_schema=model_schema)

        def after_warm_up() -> None:
            self._warmed_up()  # one export at a time
            with collector_paused():
                ahead.save()

        threading.Thread(target=after_warm_up, name="sparkdl-avg-model-ahead",
                         daemon=True).start()

    def log_model(self, model, *, schema, heads, names=None,
                  registered_model_name: str | None = None, preprocess: bytes | None = None,
                  model_schema=None, preprocess_fn=None) -> None:
        """The model, scoring `schema`'s inputs (`tracking/model`), and, named, a new
        registered version of it, ready before this returns. `preprocess_fn`: the function
        `preprocess` pickles, whose packages join the requirements."""
        import mlflow

        from sparkdl_avg.tracking.model import log_model
        from sparkdl_avg.tracking.requirements import model_requirements

        self._background_ended()  # never an export beside theirs: each sets process-wide flags
        # Explicit requirements: MLflow's inference imports the model in a subprocess (~9 s).
        with mlflow.start_run(run_id=self.run_id, nested=True):
            log_model(model, schema=schema, heads=heads, names=names,
                      pip_requirements=model_requirements(preprocess_fn),
                      registered_model_name=registered_model_name,
                      preprocess=preprocess, model_schema=model_schema, ahead=self._ahead)

    def log_adapters(self, model, trained: tuple[str, ...]) -> None:
        """What trained (`trained`: its names, `tracking/adapters`), under the run's
        `adapters/` artifacts."""
        from sparkdl_avg.tracking.adapters import log_adapters

        log_adapters(self._client, self.run_id, model, trained)

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


def _import_pyspark_ml() -> None:
    """MLflow's `Param` checks `"pyspark.ml" in sys.modules`, then reads `pyspark.ml.param`.
    While another thread is halfway through importing pyspark.ml (the fit's dataset schema,
    through MLflow's `_infer_schema`, imports it on the caller's thread), that read fails
    ("cannot access submodule 'ml' of module 'pyspark'") and the fit with it. Imported whole
    here, on the thread that writes the params, before it writes any."""
    with contextlib.suppress(ImportError):
        import pyspark.ml.param  # noqa: F401
