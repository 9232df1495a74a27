"""Spark ML: `AveragingEstimator` fits a model by parameter averaging (`sparkdl_avg.fit`) in a
`Pipeline`, and `AveragingModel` scores as `FitResult.transform` does.

    Pipeline(stages=[VectorAssembler(inputCols=[...], outputCol="features"),
                     AveragingEstimator(model_fn=make_model, config=TrainConfig(...))]).fit(df)

The Params people tune (`lr`, `epochs`, `batchSize`, `averagingFrequency`, `numWorkers`)
override the given `TrainConfig` where set. Each fit is an MLflow run; under
`CrossValidator`, whose folds fit on pool threads, over the estimator or a Pipeline holding
it, each is a child of the run that was active where `fit` was called (`copy` keeps that
run: `tracking/parent`).

`inputCols` (a list of columns, or a dict {forward parameter: column}) and `weightCol` are
`fit`'s `inputs` and `weight_col`. The fitted model of a classifier (a cross_entropy output
`[B, C]`, or a bce_with_logits output of one logit) adds `rawPredictionCol` and
`probabilityCol` (vectors) beside `predictionCol` (the class as a double), as pyspark.ml's
classifiers do, so Spark's evaluators read it with their defaults. rawPrediction is the
log-softmax of the logits (for one logit z, [-z, z]): BinaryClassificationEvaluator ranks rows
by its element 1, which must rank them as class 1's probability does (the logit z1 alone
does not).

A saved `AveragingModel` is a folder: Spark ML's `metadata/` (its Params, JSON) and
`model/`: `model.pt` (the torch module, `torch.save`) and `model.json` (the fit's DataSchema,
each output's head, rows scored at once, dtype, the sparkdl-avg version; a model saved before
typed inputs holds `num_features` and `classify` instead, and still loads), and for a fit with
`preprocess` its function, cloudpickled (`preprocess.pkl`), with the inputs it returns in
`model.json`. Loading unpickles `model.pt` through `torch.load` (`weights_only=False`: the
module's class must be importable) and `preprocess.pkl`, so load only models you trust;
nothing else is unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import os

from pyspark import keyword_only
from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import (
    HasFeaturesCol,
    HasLabelCol,
    HasPredictionCol,
    HasProbabilityCol,
    HasRawPredictionCol,
    HasWeightCol,
)
from pyspark.ml.util import (
    DefaultParamsReader,
    DefaultParamsWriter,
    MLReadable,
    MLReader,
    MLWritable,
    MLWriter,
)

from sparkdl_avg._config import TrainConfig
from sparkdl_avg._errors import ConfigError

_TUNED = {"lr": "lr", "epochs": "epochs", "batchSize": "batch_size",
          "averagingFrequency": "averaging_frequency", "numWorkers": "num_workers"}
"""Estimator Param -> the TrainConfig field it overrides."""
SCORE_ROWS = 8192
"""Rows scored at once by a model saved without its fit's eval_batch_size."""


def _to_inputs(value) -> list[str] | dict[str, str]:
    """inputCols: a list of column names (the model's positional inputs) or a dict {forward
    parameter: column} (its keyword inputs)."""
    if isinstance(value, dict) and value and all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return dict(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise TypeError(f"inputCols must be a non-empty list of column names or a dict "
                    f"{{forward parameter: column}}, got {value!r}")


class AveragingEstimator(Estimator, HasFeaturesCol, HasLabelCol, HasWeightCol, HasPredictionCol,
                         HasRawPredictionCol, HasProbabilityCol):
    """A pyspark.ml `Estimator` that trains by `sparkdl_avg.fit` and returns an `AveragingModel`.

    `model_fn`, `config`, `loss`, `eval_df` and `metrics` are `sparkdl_avg.fit`'s (with
    eval_df, the fit evaluates before training too unless `config.eval_before_training` is
    False); `inputCols` and `weightCol` its `inputs` and `weight_col`; the Params set here
    win over `config`'s fields."""

    # the Params people tune (_TUNED), declared here rather than in a mixin: the reference
    # page lists the bases, and a private one would be all a reader sees of them
    lr = Param(Params._dummy(), "lr", "learning rate (overrides config.lr)",
               typeConverter=TypeConverters.toFloat)
    epochs = Param(Params._dummy(), "epochs", "passes over each partition",
                   typeConverter=TypeConverters.toInt)
    batchSize = Param(Params._dummy(), "batchSize",  # noqa: N815 - Spark ML's name
                      "minibatch size per worker", typeConverter=TypeConverters.toInt)
    averagingFrequency = Param(Params._dummy(), "averagingFrequency",  # noqa: N815
                               "sync: optimizer steps between averaging rounds",
                               typeConverter=TypeConverters.toInt)
    numWorkers = Param(Params._dummy(), "numWorkers",  # noqa: N815 - Spark ML's name
                       "replicas trained in parallel", typeConverter=TypeConverters.toInt)

    inputCols = Param(Params._dummy(), "inputCols",  # noqa: N815 - Spark ML's name
                      "the model's inputs: a list of columns (positional) or a dict {forward "
                      "parameter: column} (keyword); fit's inputs=", typeConverter=_to_inputs)

    @keyword_only
    def __init__(self, *, model_fn=None, config: TrainConfig | None = None,
                 loss="cross_entropy", eval_df=None, featuresCol="features",  # noqa: N803
                 labelCol="label", predictionCol="prediction", inputCols=None,  # noqa: N803
                 weightCol=None, rawPredictionCol="rawPrediction",  # noqa: N803
                 probabilityCol="probability", lr=None, epochs=None,  # noqa: N803
                 batchSize=None, averagingFrequency=None, numWorkers=None,  # noqa: N803
                 preprocess=None, metrics=None) -> None:
        super().__init__()
        if model_fn is None or not callable(model_fn):
            raise ConfigError(f"AveragingEstimator needs model_fn, a zero-argument callable "
                              f"building the torch model; got {model_fn!r}")
        self.model_fn, self.config, self.loss, self.eval_df = \
            model_fn, config or TrainConfig(), loss, eval_df
        self.preprocess = preprocess
        """`fit(preprocess=)`: the model applies it too (training=False) and saves it."""
        self.metrics = metrics
        """`fit(metrics=)`: logged as eval_<name> in each fit's run."""
        kwargs = {k: v for k, v in self._input_kwargs.items()
                  if k not in ("model_fn", "config", "loss", "eval_df", "preprocess",
                               "metrics") and v is not None}
        self._set(**kwargs)
        self._callers_run: str | None = None
        """The run active where this estimator was last copied (`copy`)."""

    def copy(self, extra=None) -> AveragingEstimator:
        """As pyspark's; the copy also keeps the MLflow run active here, so that its fits on
        other threads nest under it while it runs: CrossValidator copies its estimator (a
        Pipeline copies its stages) on the caller's thread and fits the copies on a pool's
        threads, where MLflow's active run is not the caller's."""
        from sparkdl_avg.tracking.parent import callers_run

        that = super().copy(extra)
        run = callers_run()
        if run is not None:
            that._callers_run = run
        return that

    def train_config(self) -> TrainConfig:
        """`config` with the set Params in its fields (checked as any TrainConfig)."""
        overrides = {field: self.getOrDefault(param) for param, field in _TUNED.items()
                     if self.isSet(param)}
        return dataclasses.replace(self.config, **overrides)

    def _fit(self, dataset) -> AveragingModel:
        from sparkdl_avg._fit import fit
        from sparkdl_avg.tracking.parent import inherited

        with inherited(self._callers_run):
            result = fit(dataset, self.model_fn, self.train_config(), **self._fit_kwargs())
        model = AveragingModel(torch_model=result.model, schema=result.schema,
                               heads=result.heads, num_features=result.num_features,
                               classify=result.classify, run_id=result.run_id,
                               score_rows=result.score_rows, preprocess=result.preprocess,
                               model_schema=result.model_schema)
        model._set(featuresCol=self.getFeaturesCol(), predictionCol=self.getPredictionCol(),
                   rawPredictionCol=self.getRawPredictionCol(),
                   probabilityCol=self.getProbabilityCol())
        return model

    def _fit_kwargs(self) -> dict:
        """`fit`'s keyword arguments from the Params (inputs and weight_col only when set)."""
        kwargs = {"features_col": self.getFeaturesCol(), "label_col": self.getLabelCol(),
                  "loss": self.loss, "eval_df": self.eval_df, "preprocess": self.preprocess,
                  "metrics": self.metrics}
        if self.isSet(self.inputCols):
            kwargs["inputs"] = self.getOrDefault(self.inputCols)
        if self.isSet(self.weightCol) and self.getWeightCol():
            kwargs["weight_col"] = self.getWeightCol()
        return kwargs


class AveragingModel(Model, HasFeaturesCol, HasPredictionCol, HasRawPredictionCol,
                     HasProbabilityCol, MLWritable, MLReadable):
    """A trained model in a pipeline: adds `predictionCol` from the fit's inputs, scored on
    the executors: for a classifier the class index as a double (Spark ML's evaluators expect
    that) with `rawPredictionCol` and `probabilityCol` (vectors; "" leaves one out), else the
    model's output as `FitResult.transform` writes it. `score_rows`: rows the model scores at
    once (the fit's eval_batch_size). `schema`/`heads`: the fit's (`FitResult`); a model
    without them is one of a float vector of `num_features` read from `featuresCol`.
    `preprocess`/`model_schema`: the fit's (`FitResult`), run with training=False."""

    def __init__(self, torch_model=None, num_features: int = 0, classify: bool = False,
                 run_id: str | None = None, score_rows: int = SCORE_ROWS, schema=None,
                 heads: tuple[str, ...] = (), preprocess=None, model_schema=None) -> None:
        super().__init__()
        self.torch_model, self.num_features = torch_model, num_features
        self.classify, self.run_id, self.score_rows = classify, run_id, score_rows
        self.schema, self.heads = schema, tuple(heads)
        self.preprocess, self.model_schema = preprocess, model_schema

    def _result(self):
        from sparkdl_avg._fit import FitResult

        return FitResult(model=self.torch_model, run_id=self.run_id or "",
                         features_col=self.getFeaturesCol(), num_features=self.num_features,
                         classify=self.classify, score_rows=self.score_rows,
                         schema=self.schema, heads=self.heads, preprocess=self.preprocess,
                         model_schema=self.model_schema)

    def _transform(self, dataset):
        from pyspark.sql import functions as F
        from pyspark.sql import types as T

        result = self._result()
        schema, heads = result.scoring()
        single = len(schema.inputs) == 1 and schema.binding == "single"
        features = self.getFeaturesCol() if single and self.isSet(self.featuresCol) and \
            schema.inputs[0].column != self.getFeaturesCol() else None
        out = self.getPredictionCol()
        kind = _classifier_kind(self.torch_model, self.model_schema or schema, heads)
        if kind is None:
            scored = result.transform(dataset, output_col=out, features_col=features)
            if isinstance(scored.schema[out].dataType, T.LongType):  # a class index
                scored = scored.withColumn(out, F.col(out).cast(T.DoubleType()))
            return scored
        temp = f"__{self.uid}_scored"
        scored = result.transform(dataset, output_col=temp, features_col=features,
                                  output=("prediction", "raw", "probability"))
        raw, probability = F.col(f"{temp}.raw"), F.col(f"{temp}.probability")
        if kind == "binary":  # one logit z: as pyspark's LogisticRegression, [-z, z], [1-p, p]
            raw = F.array(-raw, raw)
            probability = F.array(1 - probability, probability)
        else:  # log-softmax: each element ranks the rows as its class's probability does
            top = F.array_max(raw)
            total = F.aggregate(raw, F.lit(0.0), lambda acc, z: acc + F.exp(z - top))
            raw = F.transform(raw, lambda z: z - top - F.log(total))
        from pyspark.ml.functions import array_to_vector

        columns = {out: F.col(f"{temp}.prediction").cast(T.DoubleType())}
        if self.getRawPredictionCol():
            columns[self.getRawPredictionCol()] = array_to_vector(raw)
        if self.getProbabilityCol():
            columns[self.getProbabilityCol()] = array_to_vector(probability)
        return scored.withColumns(columns).drop(temp)

    def write(self) -> MLWriter:
        return _ModelWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        return _ModelReader(cls)


def _classifier_kind(model, schema, heads) -> str | None:
    """"multiclass" (one cross_entropy output of shape (C,) a row), "binary" (one
    bce_with_logits logit a row) or None: the models whose rows Spark ML's classification
    columns describe."""
    if len(heads) != 1 or heads[0] == "value":
        return None
    import copy

    from sparkdl_avg.scoring.outputs import describe_outputs

    # a copy on the CPU in eval mode, as scoring probes: the model may sit on a GPU or train
    probe = copy.deepcopy(model).cpu().eval()
    outputs = describe_outputs(probe, schema.without_targets(), heads, ("raw",))
    [[spec]] = outputs.specs
    if outputs.several:
        return None
    if heads[0] == "class" and spec.rank == 1:
        return "multiclass"
    return "binary" if heads[0] == "multilabel" and spec.rank == 0 else None


class _ModelWriter(MLWriter):
    def __init__(self, instance: AveragingModel) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:  # noqa: N802 - pyspark's name
        import torch

        from sparkdl_avg._version import __version__

        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession)
        folder = os.path.join(path, "model")
        os.makedirs(folder, exist_ok=True)
        model = self.instance.torch_model
        torch.save(model, os.path.join(folder, "model.pt"))
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        schema, heads = self.instance._result().scoring()
        prep, model_schema = self.instance.preprocess, self.instance.model_schema
        if prep is not None:
            from sparkdl_avg._model import pickle_for_executors

            with open(os.path.join(folder, "preprocess.pkl"), "wb") as f:
                f.write(pickle_for_executors("preprocess", prep))  # by value: a job's own
        with open(os.path.join(folder, "model.json"), "w") as f:
            json.dump({"schema": schema.to_dict(), "heads": list(heads), "dtype": dtype,
                       "model_schema": model_schema.to_dict() if prep is not None else None,
                       "score_rows": self.instance.score_rows,
                       "run_id": self.instance.run_id, "sparkdl_avg": __version__}, f)


class _ModelReader(MLReader):
    def __init__(self, cls) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> AveragingModel:
        import torch

        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        folder = os.path.join(path, "model")
        with open(os.path.join(folder, "model.json")) as f:
            info = json.load(f)
        module = torch.load(os.path.join(folder, "model.pt"), weights_only=False)
        if "schema" in info:
            from sparkdl_avg.data.schema import DataSchema

            typed = {"schema": DataSchema.from_dict(info["schema"]),
                     "heads": tuple(info["heads"])}
            if info.get("model_schema"):  # fit(preprocess=)
                import cloudpickle

                with open(os.path.join(folder, "preprocess.pkl"), "rb") as f:
                    typed["preprocess"] = cloudpickle.load(f)
                typed["model_schema"] = DataSchema.from_dict(info["model_schema"])
        else:  # saved before typed inputs: a float vector read from featuresCol
            typed = {"num_features": info["num_features"], "classify": info["classify"]}
        model = AveragingModel(torch_model=module.eval(), run_id=info["run_id"],
                               # saved before it was kept: what scoring then used
                               score_rows=info.get("score_rows", SCORE_ROWS), **typed)
        model._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(model, metadata)
        return model
