"""`TrainConfig`: everything about a fit that is not the data or the model."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

from sparkdl_avg._errors import ConfigError

OptimizerName = Literal["sgd", "adam"]
Mode = Literal["sync", "async"]
Algorithm = Literal["downpour", "dcasgd", "dcasgd-adaptive"]
Device = Literal["auto", "cpu", "cuda"]

_OPTIMIZERS = ("sgd", "adam")
_DEVICES = ("auto", "cpu", "cuda")
_MODES = ("sync", "async")
_ALGORITHMS = ("downpour", "dcasgd", "dcasgd-adaptive")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """How to train: workers, schedule, optimizer, averaging and logging."""

    mode: Mode = "sync"
    """"sync": average every `averaging_frequency` steps. "async": push to and pull from a
    parameter server on each worker's own schedule (Downpour SGD)."""

    num_workers: int = 2
    """Replicas trained in parallel, one Spark task (and one data partition) each."""

    epochs: int = 1
    """Passes over each worker's partition."""

    batch_size: int = 32
    """Minibatch size *per worker*; the global batch is `num_workers * batch_size`."""

    averaging_frequency: int = 8
    """Local minibatches between two averaging rounds (1 = average after every step)."""

    optimizer: OptimizerName | Callable[[Any], Any] = "sgd"
    """"sgd", "adam", or a picklable callable `params -> torch.optim.Optimizer`."""

    lr: float = 0.01
    """Learning rate of the built-in optimizers."""

    momentum: float = 0.0
    """Momentum of "sgd"."""

    weight_decay: float = 0.0
    """L2 weight decay of the built-in optimizers."""

    average_optimizer_state: bool = False
    """Also average optimizer state (momentum buffers, Adam moments) at every round."""

    shuffle: bool = True
    """Reshuffle each worker's partition every epoch (seeded); False keeps the DataFrame's order."""

    seed: int = 0
    """Seeds model initialisation, shuffling and dropout: same seed and data, same parameters."""

    device: Device = "auto"
    """"auto": the GPU Spark assigned to the task if CUDA works there, else CPU. "cuda" requires
    a GPU; "cpu" ignores any."""

    eval_every: int = 1
    """Evaluate the averaged model on `eval_df` every this many rounds (and after the last)."""

    round_timeout: float = 600.0
    """Seconds the driver waits for a worker's next message (a push, an evaluation) before it
    declares the worker hung and restarts the round's training (see max_failures)."""

    max_failures: int = 3
    """Task failures (an exception, a killed worker, a lost executor, a hang) the fit recovers
    from by restarting the training job from its last checkpoint; one more fails the fit."""

    checkpoint_every: int = 10
    """Sync: every this many rounds (and after the last) the averaged parameters, each worker's
    optimizer state and the position in the data are kept as the restart point and saved to
    `checkpoint_dir` or the MLflow run. 0: keep none; a failure restarts from round 0.
    Async: the parameter server saves its state every this many pushes per worker."""

    checkpoint_dir: str | None = None
    """A directory for checkpoints (the newest two are kept); None: the MLflow run's artifacts
    under checkpoints/."""

    experiment_name: str | None = None
    """MLflow experiment; None uses the active one (MLflow's default, or the notebook's)."""

    run_name: str | None = None
    """MLflow run name; None lets MLflow pick one."""

    log_model: bool = True
    """Log the final model with `mlflow.pytorch.log_model` so `mlflow.pyfunc` can load it."""

    algorithm: Algorithm = "downpour"
    """Async: the server's rule: "downpour", "dcasgd" (delay compensation, constant lambda) or
    "dcasgd-adaptive"."""

    push_every: int = 8
    """Async: local steps between two pushes of a worker's accumulated update."""

    fetch_every: int | None = None
    """Async: local steps between two fetches of the server's parameters (a multiple of
    push_every; None: push_every)."""

    staleness_bound: int | None = None
    """Async: no worker runs more than this many pushes ahead of the slowest (0 = lockstep,
    which reproduces sync averaging); None: unbounded."""

    dc_lambda: float | None = None
    """Async DC-ASGD: lambda (default 0.04) or, adaptive, lambda0 (default 2)."""

    ps_address: str | None = None
    """Async: "host:port" of a running `sparkdl-avg ps serve`; None starts one beside the
    driver for this fit."""

    ps_secret_file: str | None = None
    """Async with ps_address: file holding the server's hex secret."""

    ps_tls_ca: str | None = None
    """Async with ps_address: CA (or the server's self-signed certificate) file; set it to
    speak TLS to a server started with --tls-cert/--tls-key and verify it."""

    eval_interval_s: float = 5.0
    """Async: evaluate the server's parameters on `eval_df` every this many seconds."""

    def __post_init__(self) -> None:
        for name in ("num_workers", "epochs", "batch_size", "averaging_frequency", "eval_every"):
            _require_int(name, getattr(self, name), minimum=1)
        _require_int("max_failures", self.max_failures, minimum=0)
        _require_int("checkpoint_every", self.checkpoint_every, minimum=0)
        if self.checkpoint_dir is not None and (
                not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir):
            raise ConfigError(f"checkpoint_dir must be a directory path, got "
                              f"{self.checkpoint_dir!r}")
        _require_int("seed", self.seed, minimum=0)
        if isinstance(self.optimizer, str):
            if self.optimizer not in _OPTIMIZERS:
                raise ConfigError(
                    f"optimizer={self.optimizer!r} is not supported; use one of {_OPTIMIZERS} "
                    "or a callable params -> torch.optim.Optimizer"
                )
        elif not callable(self.optimizer):
            raise ConfigError(f"optimizer must be a name or a callable, got {self.optimizer!r}")
        _require_float("lr", self.lr, positive=True)
        _require_float("momentum", self.momentum)
        _require_float("weight_decay", self.weight_decay)
        if self.momentum >= 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        _require_float("round_timeout", self.round_timeout, positive=True)
        if self.device not in _DEVICES:
            raise ConfigError(f"device={self.device!r} is not supported; use one of {_DEVICES}")
        if self.mode not in _MODES:
            raise ConfigError(f"mode={self.mode!r} is not supported; use one of {_MODES}")
        if self.algorithm not in _ALGORITHMS:
            raise ConfigError(f"algorithm={self.algorithm!r} is not supported; use one of "
                              f"{_ALGORITHMS}")
        _require_int("push_every", self.push_every, minimum=1)
        if self.fetch_every is not None:
            _require_int("fetch_every", self.fetch_every, minimum=1)
            if self.fetch_every % self.push_every:
                raise ConfigError(f"fetch_every={self.fetch_every} must be a multiple of "
                                  f"push_every={self.push_every} (a fetch would drop steps "
                                  "not yet pushed)")
        if self.staleness_bound is not None:
            _require_int("staleness_bound", self.staleness_bound, minimum=0)
        if self.dc_lambda is not None:
            _require_float("dc_lambda", self.dc_lambda)
        _require_float("eval_interval_s", self.eval_interval_s, positive=True)
        if self.ps_address is not None:
            host, _, port = self.ps_address.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"ps_address={self.ps_address!r} must be 'host:port'")
            if self.ps_secret_file is None:
                raise ConfigError("ps_address needs ps_secret_file: the server's secret")
        for name in ("average_optimizer_state", "shuffle", "log_model"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, str]:
        """Every field as a string, for MLflow params (callables by qualified name)."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if callable(value):
                value = getattr(value, "__qualname__", type(value).__name__)
            out[field.name] = str(value)
        return out


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")


def _require_float(name: str, value: object, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ConfigError(f"{name} must be positive, got {value}")
    if not positive and value < 0:
        raise ConfigError(f"{name} must not be negative, got {value}")
