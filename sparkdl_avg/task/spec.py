"""What a training task receives: plain picklable values, no SparkSession, no sockets."""

from __future__ import annotations

from dataclasses import dataclass

from sparkdl_avg.task.schedule import Schedule


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    address: tuple[str, int]
    """Where to connect: the driver's coordinator (sync) or the parameter server (async)."""
    secret: bytes
    config: bytes
    """The TrainConfig, cloudpickled like model_fn (so a callable optimizer from the user's own
    module travels by value)."""
    model_fn: bytes
    loss: bytes
    schedule: Schedule
    num_features: int
    double_precision: bool
    long_labels: bool
    classify: bool
    train_rows: list[int]
    eval_rows: list[int]
    """Rows per partition as validation counted them; a task that gets others stops."""
    tls_ca_pem: str | None = None
    """PEM text that verifies the driver's coordinator (sync) or the parameter server
    (async) over TLS; None: plain TCP."""
