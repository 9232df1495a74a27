"""The errors sparkdl-avg raises. Every message names what is wrong and says what to do."""

from __future__ import annotations


class SparkdlAvgError(Exception):
    """Base class of every error raised by sparkdl-avg."""


class ConfigError(SparkdlAvgError, ValueError):
    """A `TrainConfig` field or a `fit` argument has an invalid value."""


class DataError(SparkdlAvgError, ValueError):
    """The training or evaluation DataFrame cannot be used as given."""


class ModelError(SparkdlAvgError, ValueError):
    """`model_fn` failed to build, to pickle, or builds a model that does not fit the data."""


class ClusterError(SparkdlAvgError, RuntimeError):
    """The Spark cluster cannot run the fit as configured (too few slots, GPU settings)."""


class TrainingError(SparkdlAvgError, RuntimeError):
    """Training failed on an executor, or a worker stopped answering."""


class ProtocolError(SparkdlAvgError, ConnectionError):
    """A peer sent a frame that is malformed, oversized, unauthenticated or unexpected."""


class WorkerLostError(TrainingError):
    """Internal: a training task failed, hung or disconnected. The fit restarts from its last
    checkpoint while `max_failures` allows, else reports it as a TrainingError."""

    def __init__(self, message: str, *, partition: int | None = None,
                 reported: str | None = None) -> None:
        super().__init__(message)
        self.partition = partition
        self.reported = reported
        """The exception the worker itself sent (None: a lost socket, a hang, a crash)."""
        self.details: dict | None = None
        """Filled in by the driver: partition, executor, host, error."""
