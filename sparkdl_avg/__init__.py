"""Train PyTorch models across a Spark cluster by parameter averaging, logged to MLflow."""

__version__ = "0.1.0"  # first: the modules below read it

from sparkdl_avg._config import TrainConfig
from sparkdl_avg._errors import (
    ClusterError,
    ConfigError,
    DataError,
    ModelError,
    ProtocolError,
    SparkdlAvgError,
    TrainingError,
)
from sparkdl_avg._fit import FitResult, fit

__all__ = [
    "ClusterError",
    "ConfigError",
    "DataError",
    "FitResult",
    "ModelError",
    "ProtocolError",
    "SparkdlAvgError",
    "TrainConfig",
    "TrainingError",
    "__version__",
    "fit",
]
