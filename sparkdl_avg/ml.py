"""Spark ML: `AveragingEstimator` fits a model by parameter averaging (`sparkdl_avg.fit`) in a
`Pipeline`, and `AveragingModel` scores as `FitResult.transform` does.

    Pipeline(stages=[VectorAssembler(inputCols=[...], outputCol="features"),
                     AveragingEstimator(model_fn=make_model, config=TrainConfig(...))]).fit(df)

The Params people tune (`lr`, `epochs`, `batchSize`, `averagingFrequency`, `numWorkers`)
override the given `TrainConfig` where set. Each fit is an MLflow run; under
`CrossValidator`, whose folds fit on pool threads, each is a child of the run that was
active where `fit` was called.

A saved `AveragingModel` is a folder: Spark ML's `metadata/` (its Params, JSON) and
`model/`: `model.pt` (the torch module, `torch.save`) and `model.json` (features, classifier
or not, rows scored at once, dtype, the sparkdl-avg version). Loading unpickles `model.pt`
through `torch.load` (`weights_only=False`: the module's class must be importable), so load
only models you trust; nothing else is unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import os

from pyspark import keyword_only
from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasFeaturesCol, HasLabelCol, HasPredictionCol
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


class _TunedParams(Params):
    lr = Param(Params._dummy(), "lr", "learning rate (overrides config.lr)",
               typeConverter=TypeConverters.toFloat)
    epochs = Param(Params._dummy(), "epochs", "passes over each partition",
                   typeConverter=TypeConverters.toInt)
    batchSize = Param(Params._dummy(), "batchSize", "minibatch size per worker",
                      typeConverter=TypeConverters.toInt)
    averagingFrequency = Param(Params._dummy(), "averagingFrequency",
                               "sync: optimizer steps between averaging rounds",
                               typeConverter=TypeConverters.toInt)
    numWorkers = Param(Params._dummy(), "numWorkers", "replicas trained in parallel",
                       typeConverter=TypeConverters.toInt)


class AveragingEstimator(Estimator, HasFeaturesCol, HasLabelCol, HasPredictionCol,
                         _TunedParams):
    """`model_fn`, `config`, `loss` and `eval_df` are `sparkdl_avg.fit`'s; the Params set
    here win over `config`'s fields."""

    @keyword_only
    def __init__(self, *, model_fn=None, config: TrainConfig | None = None,
                 loss="cross_entropy", eval_df=None, featuresCol="features",  # noqa: N803
                 labelCol="label", predictionCol="prediction", lr=None, epochs=None,  # noqa: N803
                 batchSize=None, averagingFrequency=None, numWorkers=None) -> None:  # noqa: N803
        super().__init__()
        if model_fn is None or not callable(model_fn):
            raise ConfigError(f"AveragingEstimator needs model_fn, a zero-argument callable "
                              f"building the torch model; got {model_fn!r}")
        self.model_fn, self.config, self.loss, self.eval_df = \
            model_fn, config or TrainConfig(), loss, eval_df
        kwargs = {k: v for k, v in self._input_kwargs.items()
                  if k not in ("model_fn", "config", "loss", "eval_df") and v is not None}
        self._set(**kwargs)

    def train_config(self) -> TrainConfig:
        """`config` with the set Params in its fields (checked as any TrainConfig)."""
        overrides = {field: self.getOrDefault(param) for param, field in _TUNED.items()
                     if self.isSet(param)}
        return dataclasses.replace(self.config, **overrides)

    def _fit(self, dataset) -> AveragingModel:
        from sparkdl_avg._fit import fit

        result = fit(dataset, self.model_fn, self.train_config(),
                     features_col=self.getFeaturesCol(), label_col=self.getLabelCol(),
                     loss=self.loss, eval_df=self.eval_df)
        model = AveragingModel(torch_model=result.model, num_features=result.num_features,
                               classify=result.classify, run_id=result.run_id,
                               score_rows=result.score_rows)
        model._set(featuresCol=self.getFeaturesCol(), predictionCol=self.getPredictionCol())
        return model

    def fitMultiple(self, dataset, paramMaps):  # noqa: N802 - pyspark's name
        """As pyspark's, plus: the MLflow run active here (on the caller's thread) becomes
        the parent of every fit, which CrossValidator runs on its pool threads."""
        import mlflow

        from sparkdl_avg.tracking.run import parent_run

        active = mlflow.active_run()
        parent = active.info.run_id if active is not None else None
        estimator = self.copy()

        def fit_one(index: int):
            with parent_run(parent):
                return estimator.fit(dataset, paramMaps[index])

        from pyspark.ml.base import _FitMultipleIterator

        return _FitMultipleIterator(fit_one, len(paramMaps))


class AveragingModel(Model, HasFeaturesCol, HasPredictionCol, MLWritable, MLReadable):
    """A trained model in a pipeline: adds `predictionCol` from `featuresCol`, scored on the
    executors: for a classifier the class index as a double (Spark ML's evaluators expect
    that), else the model's output. `score_rows`: rows the model scores at once (the fit's
    eval_batch_size)."""

    def __init__(self, torch_model=None, num_features: int = 0, classify: bool = False,
                 run_id: str | None = None, score_rows: int = SCORE_ROWS) -> None:
        super().__init__()
        self.torch_model, self.num_features = torch_model, num_features
        self.classify, self.run_id, self.score_rows = classify, run_id, score_rows

    def _transform(self, dataset):
        from sparkdl_avg._fit import FitResult

        result = FitResult(model=self.torch_model, run_id=self.run_id or "",
                           features_col=self.getFeaturesCol(),
                           num_features=self.num_features, classify=self.classify,
                           score_rows=self.score_rows)
        out = self.getPredictionCol()
        scored = result.transform(dataset, output_col=out)
        if self.classify:
            from pyspark.sql import functions as F
            from pyspark.sql import types as T

            scored = scored.withColumn(out, F.col(out).cast(T.DoubleType()))
        return scored

    def write(self) -> MLWriter:
        return _ModelWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        return _ModelReader(cls)


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
        with open(os.path.join(folder, "model.json"), "w") as f:
            json.dump({"num_features": self.instance.num_features,
                       "classify": self.instance.classify, "dtype": dtype,
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
        model = AveragingModel(torch_model=module.eval(), num_features=info["num_features"],
                               classify=info["classify"], run_id=info["run_id"],
                               # saved before it was kept: what scoring then used
                               score_rows=info.get("score_rows", SCORE_ROWS))
        model._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(model, metadata)
        return model
