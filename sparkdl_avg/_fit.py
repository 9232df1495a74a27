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
from sparkdl_avg._metrics import Metric
from sparkdl_avg.data.describe import ident_columns, input_columns
from sparkdl_avg.data.schema import DataSchema
from sparkdl_avg.driver.asynchronous import train_async
from sparkdl_avg.driver.checkpoints import open_source
from sparkdl_avg.driver.plan import FitPlan, Resume, make_plan
from sparkdl_avg.driver.session import default_executor_python
from sparkdl_avg.driver.sync import train_sync
from sparkdl_avg.scoring.columns import vector_schema, with_column
from sparkdl_avg.scoring.outputs import output_names
from sparkdl_avg.scoring.udf import make_predict_udf
from sparkdl_avg.tracking.adapters import trained_names
from sparkdl_avg.tracking.datasets import log_datasets
from sparkdl_avg.tracking.model_ahead import applies as saves_ahead
from sparkdl_avg.tracking.plots import learning_curves
from sparkdl_avg.tracking.run import RunLogger
from sparkdl_avg.tracking.workers import log_workers

log = logging.getLogger("sparkdl_avg")


class _BuiltOnRequest:
    """`FitResult.model`: a module as given, or a zero-argument callable that builds it on
    first access (`driver_model="meta"`: the whole model is assembled only if asked for)."""

    def __get__(self, obj, owner=None):
        if obj is None:
            raise AttributeError("model")  # for dataclass: the field has no default
        value = obj._model
        if not isinstance(value, torch.nn.Module):
            value = obj._model = value()
        return value

    def __set__(self, obj, value) -> None:
        obj._model = value


@dataclass(eq=False)
class FitResult:
    """What `fit` returns."""

    model: torch.nn.Module = _BuiltOnRequest()  # type: ignore[assignment]
    """The final averaged model, on the CPU, in eval mode. Integer buffers (BatchNorm's
    `num_batches_tracked`) are never averaged: sync mode returns worker 0's (every replica
    takes the same steps); async mode keeps the initial ones. With
    `driver_model="meta"`, built on first access (`model_fn` again, and the trained state)."""
    run_id: str
    """The MLflow run that recorded this fit."""
    history: list[dict] = field(default_factory=list)
    """The metrics logged to MLflow: one dict per averaging round in sync mode, per evaluation
    interval (`eval_interval_s`) in async mode, and first, with eval_df, round 0: the
    evaluation before training (`TrainConfig.eval_before_training`), without train_loss.
    MLflow's step is the round, counted as rounds done (1 after the first). Keys:

    - sync, every training round: `round`, `train_loss`, `lr`, `samples_per_s`,
      `replica_divergence`, `driver_mb`, `wire_mb` (the parameter exchange's bytes, all
      workers and both directions), `workers` (replicas averaged), `skipped_rows` (rows the
      absent ones did not train: elastic fits), `time_round_s`, `time_compute_s`,
      `time_communication_s`, `time_averaging_s`;
    - sync, a round that takes an outer step (`outer_optimizer` other than "average", past
      the warm-up): also `outer_update_norm`;
    - sync, a round that evaluates eval_df (round 0 included): also `eval_loss`,
      `time_eval_s`, for a loss that classifies `eval_accuracy`, and `eval_<name>` for each
      of `fit(metrics=)`;
    - async, every interval: `interval` (from 0), `round` (MLflow's step:
      updates_applied // num_workers, a round being push_every local steps of each worker, so
      a sync run averaging every push_every steps shares its x axis), `updates_applied`,
      `updates_per_s`, `staleness_mean_worker_<w>` for each worker w heard from;
    - async, an interval that has them: `train_loss` and `samples_per_s` (samples arrived),
      `staleness_mean` and `staleness_max`, `lr`, and `eval_loss`, `time_eval_s`,
      `eval_accuracy` and `eval_<name>` (in the interval whose parameters the workers
      evaluated);
    - both modes, once any stranger was refused: `refused_<reason>`, the count so far."""
    workers: list[dict] = field(default_factory=list)
    """One dict per task, in partition order, as the task reported it:

    - where it ran: `partition`, `host`, `pid`, `device` ("cpu", "cuda:0", ...), `gpu` (its
      GPU's address, or None), `version` and `library` (the sparkdl-avg it imported, and
      its folder), `warning` (what the task wants you to know, or None);
    - its rows: `train_rows` and `eval_rows` (of train_df and eval_df), and `load_s`, the
      seconds it took to load them;
    - its data cache: `cache` ("memory" or "disk"), `spilled_mb` (written to disk),
      `load_mb_s` (loading the partition), `read_mb_s` (reading minibatches as the model
      gets them), `batch_wait_s` (the training thread's wait for its minibatches);
    - its memory: `start_rss_mb` and `peak_rss_mb`, resident (None off Linux);
    - its ragged inputs: `ragged_positions` trained on and `pad_positions` of them padding
      (0 without any), and their share `pad_fraction` (None without any)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent in each phase of the fit: `validate_s`, `first_step_s` (from the start
    to the first training step), `train_s`, `log_model_s` (when it logs the model) and
    `total_s`."""
    failures: list[dict] = field(default_factory=list)
    """The task failures the fit recovered from: partition, executor, host, error, and where
    training restarted (`restart_at`); an elastic fit's losses, not restarted (`restart_at`
    None): also `round_lost`, `round_back` (None: never), `attempt` and `attempt_back`
    (Spark's task attempt ids), `seconds_away` and `skipped_rows`; an async task Spark ran
    again alone: `retried_alone` True and `back_at_s`."""
    features_col: str | Sequence[str] = "features"
    """Where the fit read its features (a fit of one float vector); `transform` reads the same
    by default."""
    num_features: int = 0
    """With no `schema`: the width of that vector."""
    classify: bool = False
    """With no `heads`: a classifier (cross_entropy): predictions are class indices."""
    score_rows: int = 8192
    """Rows the model scores at once: the fit's eval_batch_size (by default 16 batches, at
    most 8 MiB of features)."""
    schema: DataSchema | None = None
    """Every input and label of the fit: the columns scoring reads, with their dtype and
    shape. None: one float vector of `num_features` values from `features_col`."""
    heads: tuple[str, ...] = ()
    """How scoring reads each model output: "class", "multilabel" or "value", from the fit's
    loss (under loss="model", from the model's config's problem_type). Empty: from
    `classify`."""
    preprocess: Callable[..., dict] | None = None
    """`fit(preprocess=)`: scoring runs it (training=False) on the raw input columns."""
    model_schema: DataSchema | None = None
    """With `preprocess`: the inputs the model gets (what preprocess returns)."""

    def __repr__(self) -> str:  # never builds a model not yet built
        model = self._model if isinstance(self._model, torch.nn.Module) else \
            "built on request"
        model = type(model).__name__ if isinstance(model, torch.nn.Module) else model
        return (f"FitResult(model={model}, run_id={self.run_id!r}, "
                f"rounds={len(self.history)}, workers={len(self.workers)})")

    def scoring(self) -> tuple[DataSchema, tuple[str, ...]]:
        """The schema and heads scoring works from (built from `num_features` and
        `classify` for a result made without them)."""
        schema = self.schema
        if schema is None:
            dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
            schema = vector_schema(self.features_col, self.num_features,
                                   dtype if dtype == "float64" else "float32")
        heads = self.heads or (("class",) if self.classify else ("value",))
        return schema, tuple(heads)

    def predict_udf(self, device: str = "auto", batch_size: int | None = None,
                    output: str = "prediction"):
        """A column function for `select`/`withColumn`/SQL that scores the fit's inputs, given
        as its arguments in the fit's order, on the executors (batched through Arrow, on the
        task's GPU when it has one). `output`: "prediction" (a classifier's class index, else
        the value), "probability" or "raw" (the logits); see `transform`. `batch_size`: rows
        per forward call; None: the fit's eval_batch_size. A null, NaN or infinite input
        fails the query: the executors raise a DataError, which reaches the driver inside
        Spark's PythonException."""
        return self._udf(self.scoring()[0], device, batch_size, output)

    def _udf(self, schema: DataSchema, device: str, batch_size: int | None, output,
             idents: bool = False):
        heads = self.scoring()[1]
        names = output_names(schema, len(heads)) if schema.label_list else None
        return make_predict_udf(self.model, schema=schema, heads=heads, output=output,
                                names=names, device=device,
                                batch_size=batch_size or self.score_rows,
                                preprocess=self.preprocess, model_schema=self.model_schema,
                                idents=idents)

    def transform(self, df, *, output_col: str = "prediction",
                  output: str | Sequence[str] = "prediction",
                  features_col: str | Sequence[str] | None = None, device: str = "auto",
                  batch_size: int | None = None):
        """`df` with the model's outputs added as `output_col`, read from the same inputs as
        the fit (`features_col`: another column for a one-input model). `output`:
        "prediction" (a classifier's class index as a long, a multi-label output's 0/1, a
        regressor's value as a double), "probability" (softmax or sigmoid of the logits) or
        "raw" (the logits). A row's output of shape (K,) is an array<double>, (T, K) nested
        arrays; a per-token output is cut to its row's length; several outputs are a struct
        with a field per label column. A list of outputs (["prediction", "probability"]) is
        a struct with a field per output, from one pass of the model. A null, NaN or
        infinite input fails the query with a DataError naming the column, raised on the
        executors (the driver gets Spark's PythonException carrying it)."""
        if not isinstance(output_col, str) or not output_col:
            raise ConfigError(f"output_col must be a column name, got {output_col!r}")
        if output_col in getattr(df, "columns", []):
            raise DataError(f"df already has a column {output_col!r}; choose another "
                            "output_col")
        if hasattr(df, "sparkSession"):  # a session no fit has used: its scoring UDF's Python
            default_executor_python(df.sparkSession)
        schema = self.scoring()[0]
        if features_col is not None and self.preprocess is not None:
            raise ConfigError("features_col= cannot rename the inputs of a fit with "
                              "preprocess: it reads the columns it was fit on")
        if features_col is not None:
            schema = with_column(schema, features_col)
        # with a preprocess, the row's path (or id...) rides along: an error names the row
        named = self.preprocess is not None and bool(schema.idents) and \
            schema.idents[0].column in getattr(df, "columns", [])
        udf = self._udf(schema, device, batch_size, output, idents=named)
        return df.withColumn(output_col, udf(*input_columns(df, schema),
                                             *(ident_columns(df, schema) if named else ())))


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
    preprocess: Callable[..., dict] | None = None,
    metrics: Sequence[str | Metric | Callable] | None = None,
) -> FitResult:
    """Train `model_fn()` on `train_df` across `config.num_workers` Spark tasks by periodic
    parameter averaging, logging the run to MLflow. The model takes `features_col` (one column
    of any supported type, or numeric columns assembled into a vector) as model(x), or
    `inputs`: a list of columns as model(*tensors), a dict {forward parameter: column} as
    model(**tensors). `label_col`: one column, or a list when the model returns a tuple of
    outputs (with a list of losses, weighted by `loss_weights`). `weight_col`: a weight >= 0
    per row; the loss is the weighted mean of the rows' losses. `loss`: a built-in name, a
    callable, or "model": the model's own loss (a Hugging Face model's), the label column
    passed to forward as `labels=` and the loss read from the output's `.loss` (a model
    returning a `ModelOutput` is read as its `.logits` by every other loss and by scoring).
    Only what trains is averaged (parameters with requires_grad, floating buffers of modules
    in training mode); `config.log_model="adapters"` logs only that, as files (a PEFT model's
    adapters), instead of the whole model. `resume_from` (sync mode): a checkpoint directory
    or the MLflow run id of a fit whose driver died; it continues from that fit's newest
    checkpoint. `on_round`: called with each logged round's metrics (and "round"); True stops
    the fit there. `preprocess`: fn(batch, *, training, rng) -> dict, run on each
    minibatch's raw columns off the training thread (binary columns arrive as a list of bytes;
    Spark's image source struct as {"data": list of bytes, "height", "width", "nChannels",
    "mode": int32 arrays}, without its origin); what it returns is what the model gets. The full
    contract: the user guide's "Records that need decoding" (docs/guide/preprocess.md).
    `metrics`: evaluation metrics beyond eval_loss and eval_accuracy, each logged as
    eval_<name> at every evaluation (needs eval_df): "auc" (binary classifiers), "perplexity"
    (cross_entropy), a `Metric`, or a callable (output, label, weights) -> (numerator,
    denominator); exact over chunks and workers (docs/guide/mlflow.md#evaluation-metrics)."""
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
                                                           weight_col, loss, loss_weights,
                                                           metrics)})
        resume = None
        if resume_from is not None:
            if config.mode != "sync":
                raise ConfigError("resume_from needs mode='sync'; an async fit restarts its "
                                  "parameter server from the server's own checkpoint")
            resume = Resume(*open_source(resume_from, run.tracking_uri))
        run.warm_up()  # in the wait for the first Spark job: cold executors import torch
        plan = make_plan(spark, train_df, eval_df, model_fn, config, features_col=features_col,
                         inputs=inputs, label_col=label_col, weight_col=weight_col, loss=loss,
                         loss_weights=loss_weights, resume=resume, on_round=on_round,
                         preprocess=preprocess, metrics=metrics)
        run.log_params(plan.params)
        run.opened()  # MLflow's schema modules imported, by one thread only
        if saves_ahead(config):  # the export's trace while the fit trains
            run.save_model_ahead(plan.model, **_model_saving(plan, preprocess))
        log_datasets(run, train_df, sum(plan.data.train_sizes), eval_df,
                     sum(plan.data.eval_sizes))
        run.ready()  # a tracking store that fails stops the fit before training
        validate_s = time.perf_counter() - t_start
        outcome = _TRAIN[config.mode](spark, plan, run)
        log_workers(outcome.workers, run)
        run.log_figure(lambda: learning_curves(outcome.history, "round"),
                       "plots/learning_curves.png")
        # what trained, named before the result goes to eval mode (which hides the buffers of
        # the modules that trained in training mode): log_model="adapters" saves them
        trained = trained_names(plan.model) if config.log_model else ()
        model = _result_model(plan, run, trained)
        timings = {"validate_s": validate_s, "first_step_s": outcome.first_step_at - t_start,
                   "train_s": outcome.train_s}
        if config.log_model:
            t_log = time.perf_counter()
            _log_model(run, plan, model, trained, preprocess)
            timings["log_model_s"] = time.perf_counter() - t_log
        timings["total_s"] = time.perf_counter() - t_start
        run.log_metrics({f"time_{k}": v for k, v in timings.items()}, step=0)
        run.log_dict({"workers": outcome.workers, "timings": timings,
                      "failures": outcome.failures}, "fit_summary.json")
        return FitResult(model=model, run_id=run.run_id, history=outcome.history,
                         workers=outcome.workers, timings=timings, failures=outcome.failures,
                         features_col=features_col, num_features=plan.data.num_features or 0,
                         classify=plan.objective.classify, score_rows=config.eval_rows(
                             (plan.model_schema or plan.data.schema).padded_row_bytes(
                                 plan.data.longest)),
                         schema=plan.data.schema, heads=plan.heads,
                         preprocess=preprocess, model_schema=plan.model_schema)


def _data_params(features_col, inputs, label_col, weight_col, loss, loss_weights,
                 metrics=None) -> dict:
    """The fit's data arguments as MLflow params (what each names; None where unset)."""
    def name(value):
        if isinstance(value, (list, tuple)):
            return [name(v) for v in value]
        if isinstance(value, Metric):
            return value.name
        return getattr(value, "__qualname__", value)

    params = {"features_col": features_col if inputs is None else None, "inputs": inputs,
              "label_col": label_col, "weight_col": weight_col, "loss": name(loss),
              "loss_weights": loss_weights,
              "metrics": name(metrics)}
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


def _result_model(plan: FitPlan, run: RunLogger, trained: tuple[str, ...]):
    """FitResult.model: the trained model in eval mode (dropout and batch statistics off).
    With driver_model="meta" it is assembled once, now if log_model=True needs it, else
    when first read; if it cannot be assembled here (the driver cannot read model_fn's
    weights, or hold them), the training is kept: the adapters (the tensors named
    `trained`) are logged instead, and reading FitResult.model raises the error."""
    if plan.config.driver_model == "full" or plan.config.log_model is not True:
        return plan.trained_model() if plan.config.driver_model == "full" \
            else plan.trained_model
    try:
        return plan.trained_model()
    except Exception as exc:  # noqa: BLE001 - the fit keeps what it trained
        log.warning("driver_model='meta': the whole model could not be assembled on the "
                    "driver (%r); logging what trained as adapters instead", exc)
        run.log_adapters(plan.model, trained)
        return plan.trained_model


def _log_model(run: RunLogger, plan: FitPlan, model, trained: tuple[str, ...],
               preprocess=None) -> None:
    """The trained model to the run, scoring the fit's inputs as `transform` does
    (`tracking/model`; a PEFT model merged into its base); with log_model="adapters", only
    what trained (the tensors named `trained`), as files (`tracking/adapters`)."""
    if plan.config.log_model == "adapters":
        run.log_adapters(plan.model, trained)
        return
    if not isinstance(model, torch.nn.Module):  # "meta", not assembled: adapters went instead
        return
    run.log_model(model, registered_model_name=plan.config.registered_model_name,
                  **_model_saving(plan, preprocess))


def _model_saving(plan: FitPlan, preprocess=None) -> dict:
    """How the fit's model is saved, whether trained or ahead (`RunLogger.log_model`)."""
    schema, heads = plan.data.schema, plan.heads
    return {"schema": schema, "heads": heads, "preprocess_fn": preprocess,
            "names": output_names(schema, len(heads)) if schema.label_list else None,
            "preprocess": plan.pickled.get("preprocess"), "model_schema": plan.model_schema}
