"""The plan of a fit: everything decided and checked on the driver before a task starts, and
what training hands back (`TrainOutcome`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparkdl_avg._config import TrainConfig
from sparkdl_avg._controls import check_early_stopping, check_warmup
from sparkdl_avg._errors import ConfigError, DataError
from sparkdl_avg._losses import Objective, make_objective
from sparkdl_avg._metrics import check_table_rows, make_metrics, name_of
from sparkdl_avg._model import (
    build_model,
    check_model_takes_data,
    heard_warnings,
    model_dtype,
    pickle_for_executors,
)
from sparkdl_avg._model_output import model_head
from sparkdl_avg._spark_compat import check_pyspark
from sparkdl_avg.averaging.flat_buffer import averaged_tensors, wire_dtype
from sparkdl_avg.averaging.frozen import Fingerprint
from sparkdl_avg.averaging.global_step import build_outer
from sparkdl_avg.averaging.outer import OuterOptimizer
from sparkdl_avg.data.order import epoch_length, padded_rows
from sparkdl_avg.data.prepare import PreparedData, prepare
from sparkdl_avg.data.probe_batch import first_rows, passed_ranges
from sparkdl_avg.data.schema import DataSchema
from sparkdl_avg.driver import session
from sparkdl_avg.driver.checkpoints import Checkpoint, DirStore, MlflowStore
from sparkdl_avg.driver.cluster import check_cluster
from sparkdl_avg.driver.meta_model import assemble, build_on_meta, initial_state
from sparkdl_avg.ps.shards import bounds as shard_bounds
from sparkdl_avg.scoring.outputs import heads_of
from sparkdl_avg.task.optimizer_step import check_schedule
from sparkdl_avg.task.schedule import Schedule, make_schedule
from sparkdl_avg.task.spec import WorkerSpec

log = logging.getLogger("sparkdl_avg")


@dataclass(frozen=True, slots=True)
class Resume:
    """A sync fit continuing another's newest checkpoint (`fit(resume_from=...)`)."""

    point: Checkpoint
    source: DirStore | MlflowStore


@dataclass(frozen=True, slots=True)
class FitPlan:
    config: TrainConfig
    model: torch.nn.Module
    """Holds the initial parameters every replica gets; the drivers leave the result here."""
    dtype: torch.dtype
    data: PreparedData
    schedule: Schedule
    objective: Objective
    pickled: dict[str, bytes]
    """model_fn, loss and config, cloudpickled for the executors."""
    params: dict[str, object]
    """What the plan learned, for the MLflow run's params."""
    resume: Resume | None = None
    frozen: dict | None = None
    """The frozen tensors' fingerprint every replica must build (`Fingerprint.to_dict`; no
    tensors when nothing is frozen: a replica that freezes something is refused too)."""
    on_round: Callable[[dict], bool] | None = None
    """`fit(on_round=)`: sees each logged round's metrics; True stops the fit."""
    model_fn: Callable[[], torch.nn.Module] | None = None
    model_schema: DataSchema | None = None
    """With `fit(preprocess=)`: the fields the model gets (what preprocess returned for a
    sample of train_df); `data.schema` stays what is carried and cached. None: the same."""
    heads: tuple[str, ...] = ()
    """Each output's scoring head (`scoring.outputs`): from the loss, or under loss="model"
    from the model and its probe output (`_model_output.model_head`)."""
    build_warnings: tuple[str, ...] = ()
    """What the driver's build of model_fn warned of (`_model.heard_warnings`)."""
    outer: OuterOptimizer | None = None
    """Sync: the outer optimizer over the trainable parameters (`outer_optimizer`), built
    once; the driver steps it with the "driver" transport."""

    def trained_model(self) -> torch.nn.Module:
        """The whole trained model, in eval mode: `model` itself, or with
        `driver_model="meta"` (whose `model` holds only what trained) one assembled from it."""
        if self.config.driver_model != "meta":
            return self.model.eval()
        return assemble(self.model_fn, self.config.seed, self.model, self.frozen)

    def params_of_data(self) -> dict[str, object]:
        return describe_params(self.data.schema)

    def worker_spec(self, address: tuple[str, int], tls_ca_pem: str | None = None) -> WorkerSpec:
        """What every task gets: no key (each task claims its own, `task.enrolment`)."""
        return WorkerSpec(
            address=address, config=self.pickled["config"],
            model_fn=self.pickled["model_fn"], loss=self.pickled["loss"],
            schedule=self.schedule, schema=self.data.schema,
            ragged_values=self.data.ragged_values, longest=self.data.longest,
            train_rows=self.data.train_sizes,
            eval_rows=self.data.eval_sizes, num_workers=self.config.num_workers,
            model_dtype=str(self.dtype).removeprefix("torch."),
            tls_ca_pem=tls_ca_pem, frozen=self.frozen,
            preprocess=self.pickled.get("preprocess"), model_schema=self.model_schema,
            build_warnings=self.build_warnings)


@dataclass(slots=True)
class TrainOutcome:
    """What a mode's driver returns; the final parameters are in `FitPlan.model`."""

    history: list[dict]
    """The metrics logged per round (sync) or per evaluation interval (async)."""
    workers: list[dict]
    """One report per task (`task.report.FIELDS`)."""
    failures: list[dict] = field(default_factory=list)
    first_step_at: float = 0.0
    """perf_counter() when the workers started training."""
    train_s: float = 0.0


def make_plan(spark, train_df, eval_df, model_fn, config: TrainConfig, *, features_col,
              inputs=None, label_col, weight_col: str | None = None, loss,
              loss_weights=None, resume: Resume | None = None,
              on_round: Callable[[dict], bool] | None = None, preprocess=None,
              metrics=None) -> FitPlan:
    check_pyspark(spark)
    session.default_executor_python(spark)  # before the fit makes its first Python job
    if on_round is not None and not callable(on_round):
        raise ConfigError(f"on_round must be a callable metrics -> bool, got "
                          f"{type(on_round).__name__}")
    check_preprocess(preprocess)
    outputs = 1 if isinstance(label_col, str) else len(label_col) if \
        isinstance(label_col, (list, tuple)) else 1
    objective = make_objective(loss, loss_weights=loss_weights, num_outputs=outputs,
                               weighted=weight_col is not None, inputs=inputs)
    objective = dataclasses.replace(objective, metrics=make_metrics(metrics, objective))
    check_evaluation(config, objective, has_eval=eval_df is not None)
    check_early_stopping(config, has_eval=eval_df is not None, classify=objective.classify)
    torch.manual_seed(config.seed)  # the driver builds the initial parameters every replica gets
    meta = config.driver_model == "meta"
    # what model_fn's libraries warn of, shown here once; the tasks keep quiet about it
    with heard_warnings(replay=True) as heard:
        model = build_on_meta(model_fn) if meta else build_model(model_fn)
    # as built: the probe's forward may change a buffer (a cache), the replicas' will not yet
    frozen = None if meta else Fingerprint.of(model).to_dict()
    warn_eval_mode_trainers(model)
    dtype = model_dtype(model)
    check_schedule(config, model)
    if config.mode == "async":  # a model too small to shard: refused before any Spark job
        shard_bounds(sum(t.numel() for t in averaged_tensors(model)), config.ps_shards)
    outer = build_outer(config, model, dtype) if config.mode == "sync" else None
    for name in ("optimizer", "outer_optimizer"):  # fails naming it, not the whole config
        if callable(getattr(config, name)):
            pickle_for_executors(name, getattr(config, name))
    pickled = {"model_fn": pickle_for_executors("model_fn", model_fn),
               "loss": pickle_for_executors("loss", objective),
               "config": pickle_for_executors("config", config)}
    if preprocess is not None:
        pickled["preprocess"] = pickle_for_executors("preprocess", preprocess)
    if config.checkpoint_dir is not None and (config.mode == "sync" or not config.ps_address):
        check_writable(config.checkpoint_dir)  # the driver (or its sidecar) writes there
    check_cluster(spark, config)  # the first Spark job: after every check that needs none
    data = prepare(train_df, eval_df, features_col=features_col, inputs=inputs,
                   label_col=label_col, weight_col=weight_col, num_workers=config.num_workers,
                   double_precision=dtype == torch.float64,
                   class_labels=[loss == "cross_entropy" for loss in objective.losses],
                   encoded=preprocess is not None)
    model_schema, sample = None, None
    if preprocess is not None:
        model_schema, sample = sample_schema(data, preprocess, dtype, config.seed)
    check_ragged_labels(model_schema or data.schema, objective)
    check_table_rows(objective.metrics, sum(data.eval_sizes))
    # the probe's data: with a preprocess, its sample, with the ranges of what it passes on
    probe = {"schema": model_schema or data.schema, "longest": data.longest, "batch": sample,
             "ranges": passed_ranges(data.schema, model_schema, data.ranges)}
    if meta:  # what trains made real, from an executor's build (which runs the probe)
        frozen = initial_state(spark, model, pickled=pickled, seed=config.seed, probe=probe,
                               deadline_s=config.waits().connect)
        probed = None  # the executor ran the probe: the driver's model has no outputs
    else:
        probed = check_model_takes_data(model, objective=objective, dtype=dtype, **probe)
    heads = (model_head(model, probed),) if objective.model_loss else heads_of(objective)
    smallest = min(data.train_sizes)
    if smallest < config.batch_size:
        raise DataError(
            f"train_df has {sum(data.train_sizes)} rows: {smallest} per worker, fewer than "
            f"batch_size={config.batch_size}; lower batch_size or num_workers"
        )
    schedule = make_schedule(epoch_length(data.train_sizes), config.batch_size, config.epochs,
                             config.averaging_frequency, config.grad_accumulation,
                             config.averaging_warmup_steps if config.mode == "sync" else 0)
    check_warmup(config, schedule.total_steps)
    padding = padded_rows(data.train_sizes)
    if padding:
        log.info("%d training rows over %d workers: %d partition(s) one row short repeat one "
                 "row an epoch, so that every epoch has every row", sum(data.train_sizes),
                 config.num_workers, padding)
    params = {**describe_params(data.schema), "train_rows": sum(data.train_sizes),
              "padded_rows": padding,
              "eval_rows": sum(data.eval_sizes), "steps_per_epoch": schedule.steps_per_epoch,
              "micro_batches_per_epoch": schedule.micro_batches_per_epoch,
              "num_rounds": schedule.num_rounds, "dtype": str(dtype),
              "model_parameters": sum(p.numel() for p in model.parameters()),
              **trained_sizes(model, dtype)}
    return FitPlan(config=config, model=model, dtype=dtype, data=data, schedule=schedule,
                   objective=objective, pickled=pickled, params=params, resume=resume,
                   frozen=frozen, on_round=on_round,
                   model_fn=model_fn, model_schema=model_schema, heads=heads,
                   build_warnings=tuple(dict.fromkeys(heard)), outer=outer)


def check_evaluation(config: TrainConfig, objective: Objective, *, has_eval: bool) -> None:
    """What evaluates needs eval_df: ConfigError for eval_before_training=True or metrics
    without it."""
    if has_eval:
        return
    if config.eval_before_training:
        raise ConfigError("eval_before_training=True evaluates on eval_df before training; "
                          "give fit an eval_df, or leave eval_before_training None")
    if objective.metrics:
        names = [name_of(m) for m in objective.metrics]
        raise ConfigError(f"metrics={names} are computed on eval_df at each evaluation; "
                          "give fit an eval_df")


def check_preprocess(preprocess) -> None:
    """ConfigError for a preprocess that is not a callable."""
    if preprocess is not None and not callable(preprocess):
        raise ConfigError(f"preprocess must be a callable (batch, *, training, rng) -> dict, "
                          f"got {type(preprocess).__name__}")


def sample_schema(data: PreparedData, preprocess, dtype: torch.dtype, seed: int,
                  rows: int = 4):
    """What the model gets, learned from `preprocess` (training=False) on the first `rows`
    rows of train_df, read as the tasks read them: (the model's `DataSchema`, the first
    `probe_batch.ROWS` of that sample as the model's `Batch`, copied: the probe's forward
    runs on these real rows)."""
    from sparkdl_avg.data.arrow_columns import read_column
    from sparkdl_avg.data.feed import Preprocessor, model_schema, step_rng
    from sparkdl_avg.data.raw_rows import call

    table = data.sample.limit(rows).toArrow()
    raw = data.schema
    parts = []
    for f in raw.carried:
        column = read_column(table.column(f.wire), f)
        parts.append((column.values, column.lengths) if f.ragged else column.values)

    def where(k: int | None, n: int) -> str:
        first = f"train_df's first {n} rows"
        return first if k is None else f"row {k} of {first}"

    out = call(preprocess, raw, parts, training=False, rng=step_rng(seed, 0, 0, 0),
               where=where)
    schema = model_schema(raw, out, table.num_rows)
    prep = Preprocessor(preprocess, raw, schema, dtype, seed=seed, partition=0)
    # the rows the probe runs on, alone: with driver_model="meta" they are shipped
    return schema, first_rows(prep([parts], training=False, rng=step_rng(seed, 0, 0, 0)))


def warn_eval_mode_trainers(model: torch.nn.Module) -> None:
    """Say so when modules that train were left in eval mode by model_fn: a PEFT model over
    `from_pretrained`'s base (which returns eval mode) trains the base's dropout off."""
    from sparkdl_avg._model import eval_mode_trainers

    names = eval_mode_trainers(model)
    if names:
        shown = ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
        log.warning("%d module(s) in eval mode hold parameters that train (%s): they train "
                    "as model_fn left them, with dropout off and BatchNorm statistics frozen; "
                    "call model.train() in model_fn to train them in training mode "
                    "(from_pretrained returns a model in eval mode)", len(names), shown)


def trained_sizes(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, float]:
    """What trains, for the run's params: its parameter count, and the megabytes of the one
    vector that is averaged (what a replica pushes or all-reduces a round, and what a
    parameter server holds)."""
    numel = sum(t.numel() for t in averaged_tensors(model))
    return {"trained_parameters": numel,
            "averaged_mb": numel * wire_dtype(dtype).itemsize / 1e6}


def check_ragged_labels(schema, objective) -> None:
    """A ragged label is padded per minibatch, and only cross_entropy knows its padding
    (integer labels padded with -100, ignored): any other built-in loss would train towards
    the pads. DataError naming the column."""
    if objective.joint:
        return
    for label, loss in zip(schema.labels, objective.losses, strict=True):
        ignored = loss == "cross_entropy" or (objective.model_loss and label.kind == "int")
        if label.ragged and isinstance(loss, str) and not ignored:  # a model's loss: -100 too
            raise DataError(
                f"{label.described} is ragged (its rows' lengths differ): padded per "
                f"minibatch, its pads would count in {loss!r}, which cannot tell them from "
                "labels. Use cross_entropy with integer labels (padded with -100, ignored), "
                "or a callable loss that masks the pads by the rows' lengths (an input "
                "column of F.size(...))")


def describe_params(schema) -> dict[str, object]:
    """The data's description as MLflow params: each field's dtype and row shape ("*": ragged),
    and `num_features` for a fit of one vector, as before typed inputs."""
    def text(f):
        shape = ",".join("*" if d == -1 else str(d) for d in f.shape)
        return f"{f.dtype}[{shape}]"

    params = {f"input.{f.name}": text(f) for f in schema.inputs}
    params.update({f"label.{f.name}": text(f) for f in schema.labels})
    if schema.weight is not None:
        params["weight"] = text(schema.weight)
    if schema.num_features is not None:
        params["num_features"] = schema.num_features
    return params


def check_writable(path: str) -> None:
    """Refuse (ConfigError) a checkpoint_dir this driver cannot create or write to, before any
    Spark job: otherwise only the first save would tell, with training under way."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(f"checkpoint_dir={path!r} is not a directory this driver can write "
                          f"checkpoints to: {exc}") from exc
