"""`fit`: DataFrame -> balanced partitions -> replicas on executors -> averaged model -> MLflow."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from sparkdl_avg._config import TrainConfig
from sparkdl_avg._errors import ConfigError, DataError
from sparkdl_avg._losses import LossFn
from sparkdl_avg._scoring import make_predict_udf
from sparkdl_avg._version import __version__
from sparkdl_avg.driver.asynchronous import train_async
from sparkdl_avg.driver.checkpoints import open_source
from sparkdl_avg.driver.plan import FitPlan, Resume, TrainOutcome, make_plan
from sparkdl_avg.driver.sync import train_sync
from sparkdl_avg.tracking.datasets import log_datasets
from sparkdl_avg.tracking.plots import learning_curves
from sparkdl_avg.tracking.run import RunLogger

log = logging.getLogger("sparkdl_avg")


@dataclass(slots=True)
class FitResult:
    """What `fit` returns."""

    model: torch.nn.Module
    """The final averaged model, on the CPU, in eval mode. Integer buffers (BatchNorm's
    `num_batches_tracked`) are never averaged: sync mode returns worker 0's (every replica
    takes the same steps); async mode keeps the initial ones."""
    run_id: str
    """The MLflow run that recorded this fit."""
    history: list[dict] = field(default_factory=list)
    """The metrics logged to MLflow: one dict per averaging round in sync mode, per evaluation
    interval (`eval_interval_s`) in async mode. MLflow's step is the round; in async mode
    `updates_applied // num_workers`, a round being `push_every` local steps of each worker,
    so a sync run averaging every `push_every` steps shares its x axis."""
    workers: list[dict] = field(default_factory=list)
    """One dict per task: partition, host, device, GPU address, rows."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent in each phase of the fit (validation, first step, training, logging)."""
    failures: list[dict] = field(default_factory=list)
    """The task failures the fit recovered from: partition, executor, host, error, and where
    training restarted (`restart_at`)."""
    features_col: str | Sequence[str] = "features"
    """Where the fit read its features; `transform` reads the same by default."""
    num_features: int = 0
    classify: bool = False
    """A classifier (cross_entropy): predictions are class indices."""
    score_rows: int = 8192
    """Rows the model scores at once (`TrainConfig.eval_rows`: eval_batch_size)."""

    def predict_udf(self, device: str = "auto", batch_size: int | None = None):
        """A column function for `select`/`withColumn`/SQL that scores an array<float|double>
        features column on the executors (batched through Arrow, on the task's GPU when it
        has one): the class index for a classifier, else the value (array<double> for several
        outputs). `batch_size`: rows per forward call; None: the fit's eval_batch_size. A
        null, NaN or infinite feature fails the query: the executors raise a DataError, which
        reaches the driver inside Spark's PythonException."""
        return self._udf(device, batch_size, "the features column given to predict_udf")

    def _udf(self, device: str, batch_size: int | None, features: str):
        return make_predict_udf(self.model, num_features=self.num_features,
                                classify=self.classify, device=device,
                                batch_size=batch_size or self.score_rows, features=features)

    def transform(self, df, *, output_col: str = "prediction",
                  features_col: str | Sequence[str] | None = None, device: str = "auto",
                  batch_size: int | None = None):
        """`df` with the model's prediction added as `output_col`. Features are read as in
        `fit` (an array or vector column, or a list of numeric columns); a null, NaN or
        infinite feature fails the query with a DataError naming the column, raised on the
        executors (the driver gets Spark's PythonException carrying it)."""
        if not isinstance(output_col, str) or not output_col:
            raise ConfigError(f"output_col must be a column name, got {output_col!r}")
        if output_col in getattr(df, "columns", []):
            raise DataError(f"df already has a column {output_col!r}; choose another "
                            "output_col")
        double = next(self.model.parameters()).dtype == torch.float64
        name = self.features_col if features_col is None else features_col
        from sparkdl_avg.data.describe import input_columns
        from sparkdl_avg.data.schema import DataSchema, FieldSpec

        x = FieldSpec("input", "features", name if isinstance(name, str) else tuple(name),
                      "_x0", "float64" if double else "float32", (self.num_features,))
        schema = DataSchema((x,), "single", (), False,
                            float_dtype="float64" if double else "float32")
        features = input_columns(df, schema)[0]
        described = f"features column {name!r}" if isinstance(name, str) else \
            f"features columns {list(name)!r}"
        return df.withColumn(output_col, self._udf(device, batch_size, described)(features))


def fit(
    train_df,
    model_fn: Callable[[], torch.nn.Module],
    config: TrainConfig | None = None,
    *,
    features_col: str | Sequence[str] = "features",
    inputs: Sequence[str] | Mapping[str, str] | None = None,
    label_col: str | Sequence[str] = "label",
    weight_col: str | None = None,
    loss: str | LossFn | Sequence[str | LossFn] = "cross_entropy",
    loss_weights: Sequence[float] | None = None,
    eval_df=None,
    resume_from: str | None = None,
    on_round: Callable[[dict], bool] | None = None,
) -> FitResult:
    """Train `model_fn()` on `train_df` across `config.num_workers` Spark tasks by periodic
    parameter averaging, logging the run to MLflow. The model takes `features_col` (one column
    of any supported type, or numeric columns assembled into a vector) as model(x), or
    `inputs`: a list of columns as model(*tensors), a dict {forward parameter: column} as
    model(**tensors). `label_col`: one column, or a list when the model returns a tuple of
    outputs (with a list of losses, weighted by `loss_weights`). `weight_col`: a weight >= 0
    per row; the loss is the weighted mean of the rows' losses. `resume_from` (sync mode): a
    checkpoint directory or the MLflow run id of a fit whose driver died; it continues from
    that fit's newest checkpoint. `on_round`: called with each logged round's metrics (and "round");
    True stops the fit there. See README for the full contract."""
    config = TrainConfig() if config is None else config
    t_start = time.perf_counter()
    # The run opens before any check (on a thread of its own, while the checks run), so every
    # failed fit leaves a FAILED run with its error.
    with _open_run(config) as run:
        if not isinstance(config, TrainConfig):
            raise ConfigError(f"config must be a TrainConfig, got {type(config).__name__}")
        spark = getattr(train_df, "sparkSession", None)
        if spark is None:
            raise DataError(f"train_df must be a pyspark DataFrame, got "
                            f"{type(train_df).__name__}")
        run.log_params({**config.to_dict(), **_data_params(features_col, inputs, label_col,
                                                           weight_col, loss, loss_weights)})
        resume = None
        if resume_from is not None:
            if config.mode != "sync":
                raise ConfigError("resume_from needs mode='sync'; an async fit restarts its "
                                  "parameter server from the server's own checkpoint")
            resume = Resume(*open_source(resume_from, run.tracking_uri))
        run.warm_up()  # in the wait for the first Spark job: cold executors import torch
        plan = make_plan(spark, train_df, eval_df, model_fn, config, features_col=features_col,
                         inputs=inputs, label_col=label_col, weight_col=weight_col, loss=loss,
                         loss_weights=loss_weights, resume=resume, on_round=on_round)
        run.log_params(plan.params)
        run.opened()  # MLflow's schema modules imported, by one thread only
        log_datasets(run, train_df, sum(plan.data.train_sizes), eval_df,
                     sum(plan.data.eval_sizes))
        run.ready()  # a tracking store that fails stops the fit before training
        validate_s = time.perf_counter() - t_start
        outcome = _TRAIN[config.mode](spark, plan, run)
        _report_workers(outcome, run)
        run.log_figure(lambda: learning_curves(outcome.history, "round"),
                       "plots/learning_curves.png")
        model = plan.model.eval()  # a trained result predicts: dropout and batch stats off
        timings = {"validate_s": validate_s, "first_step_s": outcome.first_step_at - t_start,
                   "train_s": outcome.train_s}
        if config.log_model:
            t_log = time.perf_counter()
            _log_model(run, plan)
            timings["log_model_s"] = time.perf_counter() - t_log
        timings["total_s"] = time.perf_counter() - t_start
        run.log_metrics({f"time_{k}": v for k, v in timings.items()}, step=0)
        run.log_dict({"workers": outcome.workers, "timings": timings,
                      "failures": outcome.failures}, "fit_summary.json")
        return FitResult(model=model, run_id=run.run_id, history=outcome.history,
                         workers=outcome.workers, timings=timings, failures=outcome.failures,
                         features_col=features_col, num_features=plan.data.num_features or 0,
                         classify=plan.objective.classify, score_rows=config.eval_rows(
                             plan.data.schema.row_bytes(plan.data.ragged_values)))


def _data_params(features_col, inputs, label_col, weight_col, loss, loss_weights) -> dict:
    """The fit's data arguments as MLflow params (what each names; None where unset)."""
    def name(value):
        if isinstance(value, (list, tuple)):
            return [name(v) for v in value]
        return getattr(value, "__qualname__", value)

    params = {"features_col": features_col if inputs is None else None, "inputs": inputs,
              "label_col": label_col, "weight_col": weight_col, "loss": name(loss),
              "loss_weights": loss_weights}
    return {k: v for k, v in params.items() if v is not None}


_TRAIN = {"sync": train_sync, "async": train_async}
"""Each mode's driver: (spark, plan, run) -> TrainOutcome."""


def _open_run(config) -> RunLogger:
    """The fit's run; without a TrainConfig there are no names or mode to give it, so it goes
    to MLflow's active (else default) experiment."""
    if not isinstance(config, TrainConfig):
        return RunLogger(experiment_name=None, run_name=None, tags={})
    return RunLogger(experiment_name=config.experiment_name,
                     run_name=config.run_name or config.default_run_name(),
                     tags={"sparkdl_avg.mode": config.mode}, logs_model=config.log_model)


def _report_workers(outcome: TrainOutcome, run: RunLogger) -> None:
    for w in outcome.workers:
        if w["warning"]:
            log.warning("partition %d: %s", w["partition"], w["warning"])
        if w["version"] != __version__:
            log.warning("partition %d ran sparkdl-avg %s from %s; the driver runs %s",
                        w["partition"], w["version"], w["library"], __version__)
    run.set_tags({f"worker.{w['partition']}.device": f"{w['host']}/{w['device']}"
                  for w in outcome.workers})
    run.set_tags({f"worker.{w['partition']}.warning": w["warning"] for w in outcome.workers
                  if w["warning"]})
    run.set_tags({f"worker.{w['partition']}.data_cache": w["cache"] for w in outcome.workers})
    # what each task's data cost: memory, spill and throughput (MLflow compares runs by these)
    run.log_metrics({f"worker_{w['partition']}_{key}": w[key] for w in outcome.workers
                     for key in _WORKER_METRICS if w[key] is not None}, step=0)
    peaks = [w["peak_rss_mb"] for w in outcome.workers if w["peak_rss_mb"] is not None]
    if peaks:
        run.log_metrics({"peak_rss_mb_max": max(peaks)}, step=0)
    padding = [w["pad_fraction"] for w in outcome.workers if w["pad_fraction"] is not None]
    if padding:  # ragged inputs: the share of their positions that were padding
        run.log_metrics({"pad_fraction": sum(padding) / len(padding)}, step=0)


_WORKER_METRICS = ("peak_rss_mb", "spilled_mb", "load_s", "load_mb_s", "read_mb_s",
                   "pad_fraction")


def _log_model(run: RunLogger, plan: FitPlan) -> None:
    example = torch.zeros(2, plan.data.num_features or 1, dtype=plan.dtype)
    half = plan.dtype in (torch.float16, torch.bfloat16)  # numpy has neither
    run.log_model(plan.model, example.float().numpy() if half else example.numpy(),
                  registered_model_name=plan.config.registered_model_name)
