"""Train PyTorch models across a Spark cluster by parameter averaging, logged to MLflow.

Only the names in `__all__` are public. `fit`, `FitResult` and `local_session` load torch or
pyspark, so they are imported on first use: the parameter server's command line
(`python -m sparkdl_avg ps serve`) goes through this module and needs neither."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparkdl_avg._config import TrainConfig
from sparkdl_avg._controls import EarlyStopping
from sparkdl_avg._errors import (
    ClusterError,
    ConfigError,
    DataCacheError,
    DataError,
    ModelError,
    PreprocessError,
    ProtocolError,
    SparkdlAvgError,
    TrainingError,
)
from sparkdl_avg._metrics import Metric
from sparkdl_avg._version import __version__

SPARK_CONF: dict[str, str] = {"spark.python.daemon.module": "sparkdl_avg.task.warm_daemon"}
"""Spark settings for a session (or cluster) that runs fits: the executors' Python daemon
imports torch once and forks workers that have it (`task.warm_daemon`), so a session's first
fit does not wait for each worker to import it. Static settings: give them to the session
builder (`builder.config(k, v)`), spark-submit (`--conf`) or the cluster's Spark config, before
the session starts. The executors' Python must have sparkdl-avg installed: shipped only with
`--py-files` it is not on the daemon's path, and every Python task would fail to start."""

if TYPE_CHECKING:
    from sparkdl_avg._fit import FitResult, fit
    from sparkdl_avg._local_session import local_session

__all__ = [
    "ClusterError",
    "ConfigError",
    "DataCacheError",
    "DataError",
    "EarlyStopping",
    "FitResult",
    "Metric",
    "ModelError",
    "PreprocessError",
    "ProtocolError",
    "SPARK_CONF",
    "SparkdlAvgError",
    "TrainConfig",
    "TrainingError",
    "__version__",
    "fit",
    "local_session",
]

_LAZY = {"fit": "_fit", "FitResult": "_fit", "local_session": "_local_session"}
"""Each public name imported on first use, and its module."""


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"sparkdl_avg.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'sparkdl_avg' has no attribute {name!r}")
