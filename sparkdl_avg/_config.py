"""`TrainConfig`: everything about a fit that is not the data or the model."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Any, Literal

from sparkdl_avg._checks import (
    check_async,
    check_averaging,
    check_cache,
    check_choices,
    check_elastic,
    check_flags,
    check_mode,
    check_registered_model,
    check_sync_transport,
    parse_driver_address,
    refuse_unknown_fields,
    require_int,
)
from sparkdl_avg._controls import EarlyStopping, check_controls
from sparkdl_avg._errors import ConfigError
from sparkdl_avg._waits import Waits, waits_of
from sparkdl_avg.averaging.compression import Compression
from sparkdl_avg.net.message_base import MAX_WORKERS

OptimizerName = Literal["sgd", "adam", "adamw"]
Mode = Literal["sync", "async"]
Device = Literal["auto", "cpu", "cuda"]
DataCache = Literal["auto", "memory", "disk"]
LrSchedule = Literal["cosine", "linear"]
Precision = Literal["bf16", "fp16"]
Transport = Literal["driver", "collective"]
OuterName = Literal["average", "nesterov", "momentum"]

_OPTIMIZERS = typing.get_args(OptimizerName)
_DEVICES = typing.get_args(Device)
_MODES = typing.get_args(Mode)
_CACHES = typing.get_args(DataCache)
_TRANSPORTS = typing.get_args(Transport)

SYNC_ONLY = ("averaging_frequency", "average_optimizer_state", "eval_every", "checkpoint_every",
             "tls_cert", "tls_key", "tls_ca", "transport", "overlap_averaging",
             "outer_optimizer", "outer_lr", "outer_momentum", "averaging_warmup_steps",
             "delta_compression", "min_workers", "shared_memory")
ASYNC_ONLY = ("algorithm", "push_every", "fetch_every", "staleness_bound", "dc_lambda",
              "ps_address", "ps_secret_file", "ps_tls_ca", "eval_interval_s",
              "ps_checkpoint_every", "reconnect_timeout", "ps_shards")
"""Fields of one mode: set to anything but their default in the other mode, a ConfigError."""


@refuse_unknown_fields  # a misspelt name: a ConfigError naming the nearest field
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """How to train: workers, schedule, optimizer, averaging and logging."""

    mode: Mode = "sync"
    """"sync": average every `averaging_frequency` steps. "async": push to and pull from a
    parameter server on each worker's own schedule (Downpour SGD). Fields of the other mode
    (`SYNC_ONLY`, `ASYNC_ONLY`) must stay at their defaults."""

    num_workers: int = 2
    """Replicas trained in parallel, one Spark task (and one data partition) each."""

    epochs: int = 1
    """Passes over each worker's partition."""

    batch_size: int = 32
    """Minibatch size *per worker*; the global batch is `num_workers * batch_size`."""

    eval_batch_size: int | None = None
    """Rows a replica evaluates (and the returned model scores, by default) at once; None:
    16 x batch_size, at most 8 MiB of features a chunk. Bounds evaluation's device memory."""

    eval_before_training: bool | None = None
    """Evaluate the initial parameters on `eval_df` before the first step, logged as round 0
    (MLflow step 0, `FitResult.history[0]`, no train_loss), so the curves start where
    training starts. None: when eval_df is given. A resumed fit does not evaluate again."""

    averaging_frequency: int = 8
    """Sync: local minibatches between two averaging rounds (1 = average after every step)."""

    transport: Transport = "driver"
    """Sync: "driver" sends every replica to the driver, which averages; "collective"
    all-reduces among the tasks (gloo or NCCL, unauthenticated: trusted networks only)."""

    optimizer: OptimizerName | Callable[[Any], Any] = "sgd"
    """"sgd", "adam", "adamw" (Adam with decoupled weight decay, as fine-tuning recipes use),
    or a picklable callable `params -> torch.optim.Optimizer`."""

    lr: float = 0.01
    """Learning rate of the built-in optimizers."""

    momentum: float = 0.0
    """Momentum of "sgd"."""

    weight_decay: float = 0.0
    """Weight decay of the built-in optimizers: "sgd" and "adam" add it to the gradient (L2),
    "adamw" shrinks the weights by lr * weight_decay a step (torch's AdamW; its default 0.01)."""

    lr_schedule: LrSchedule | Callable[[Any], Any] | None = None
    """None: a constant lr. "cosine": lr * (1 + cos(pi t / T)) / 2 at optimizer step t after
    warmup, T the optimizer steps after warmup; "linear": lr * (1 - t / T). Or a picklable
    callable `optimizer -> torch.optim.lr_scheduler.LRScheduler`, stepped after every
    optimizer step. Every replica follows it identically; async pushes carry their lr."""

    warmup_steps: int = 0
    """The first this many optimizer steps take lr * (t + 1) / warmup_steps, then the
    schedule (built-in schedules and None only)."""

    grad_clip_norm: float | None = None
    """Clip the gradients' global norm to this before every optimizer step."""

    grad_accumulation: int = 1
    """Micro-batches of batch_size per optimizer step, their gradients averaged by sample
    count (an epoch's last group may be short). averaging_frequency, push_every and
    fetch_every count optimizer steps."""

    precision: Precision | None = None
    """None: the model's own dtype. "bf16" or "fp16": autocast, while parameters, optimizer
    state and averaging keep the model's dtype; "fp16" adds a gradient scaler (CUDA only)."""

    early_stopping: EarlyStopping | None = None
    """Stop once the evaluations stop improving (needs eval_df): see `EarlyStopping`."""

    average_optimizer_state: bool = False
    """Sync: also average optimizer state (momentum buffers, Adam moments) at every round."""

    overlap_averaging: bool = False
    """Sync: a worker starts its next round while its replica is being averaged, and when the
    average arrives adds what it learned since (CoCoD-SGD): the round trip hides behind
    compute, and each round starts from the average of the round before last plus the
    worker's own progress. Rounds that evaluate or checkpoint, and the last, still wait."""

    shared_memory: bool = True
    """Sync, "driver" transport: a worker on the driver's host moves its parameters through
    shared memory (/dev/shm), where both can map it, not loopback TCP. False: always TCP."""

    min_workers: int | None = None
    """Sync, "driver" transport. None: all-or-nothing (a lost task restarts every worker from
    the last checkpoint). m in 1..num_workers: elastic; Spark retries a lost task alone, each
    round averages the workers present while m are, and a returning task joins at a round
    boundary (docs/guide/faults.md)."""

    outer_optimizer: OuterName | Callable[[Any], Any] = "average"
    """Sync: what a round makes of the replicas' average. "average": the replicas take it
    (plain parameter averaging). "nesterov" (DiLoCo): an outer SGD with Nesterov momentum
    steps the global parameters on the pseudo-gradient, global minus average; "momentum"
    (SlowMo): the same with heavy-ball momentum. Or a picklable callable
    `params -> torch.optim.Optimizer`, built once over the trainable parameters. Floating
    buffers and averaged optimizer state take the plain average."""

    outer_lr: float | None = None
    """Sync: the outer optimizer's learning rate; None: 0.7 ("nesterov", "momentum")."""

    outer_momentum: float | None = None
    """Sync: the outer optimizer's momentum, in [0, 1); None: 0.9."""

    averaging_warmup_steps: int = 0
    """Sync: average after every optimizer step for the first this many steps, then every
    averaging_frequency (post-local SGD). The replicas take the plain average during the
    warm-up; the outer optimizer starts after it."""

    delta_compression: Compression = "none"
    """Sync: "none" sends the parameters each round; "bf16", "int8" or "int4" each worker's
    delta from the global parameters, in blocks of 256 values with one scale each, with
    error feedback (what quantization drops joins the next round's delta); the global
    update comes back compressed the same way. Float32 wires only (not float64 models)."""

    shuffle: bool = True
    """Reshuffle each worker's partition every epoch (seeded); False keeps the DataFrame's order."""

    shuffle_buffer_mb: int = 64
    """The shuffle window: a shuffled epoch visits its partition's chunks (about 256 KiB of
    contiguous rows each) in a seeded random order and permutes each window of about this
    many MiB as a whole; a partition that fits in one window is fully permuted. Part of the
    trajectory (the cache is not); held in memory when reading from disk, so it must fit
    cache_budget_mb."""

    data_cache: DataCache = "auto"
    """Where each task keeps its partition: "memory" (tensors on its device), "disk" (spilled
    to Spark's local directories as it arrives and read back a window at a time), or "auto":
    memory when the partition's tensors fit cache_budget_mb, else disk. The choice never
    changes the trained parameters."""

    cache_budget_mb: int = 512
    """Under data_cache="auto": the largest partition (training plus evaluation rows, as
    tensors) a task keeps in memory."""

    preprocess_threads: int = 2
    """With fit(preprocess=): the threads that run it, off the training thread."""

    prefetch_batches: int = 4
    """With fit(preprocess=): minibatches preprocessed ahead of training, taken in order."""

    seed: int = 0
    """Seeds model initialisation, shuffling and dropout: same seed and data, same parameters."""

    device: Device = "auto"
    """"auto": the GPU Spark assigned to the task if CUDA works there, else CPU. "cuda" requires
    a GPU; "cpu" ignores any."""

    deterministic: bool = False
    """Each task runs torch in deterministic mode: `torch.use_deterministic_algorithms(True)`
    (an op without a deterministic kernel raises), cuDNN's deterministic kernels without
    benchmarking, and CUBLAS_WORKSPACE_CONFIG=:4096:8. What CUDA needs for repeatable results;
    the CPU is deterministic without it."""

    driver_address: str | None = None
    """"host" or "host:port": where the executors reach this process's servers (the sync
    coordinator, listening on that port when given, or the async parameter server beside
    it). None: `spark.driver.host` on a classic session; on Spark Connect, this process's
    address on its route to the Connect server. Checked from every executor before
    training."""

    eval_every: int | None = None
    """Sync: evaluate the averaged model on `eval_df` every this many rounds (and after the
    last). None: once an epoch, after the round in which each epoch ends."""

    round_timeout: float = 600.0
    """Seconds the driver waits for a worker's next message (a push, an evaluation), whole,
    before it declares the worker hung and restarts the round's training (max_failures).
    Async: the same wait at the parameter server, and how long a push or pull held by the
    staleness bound waits for slower workers."""

    connect_timeout: float | None = None
    """Seconds workers may take to load their partitions and connect (to the driver, or the
    parameter server); None: round_timeout, but at least 300 (large data loads slowly)."""

    reply_timeout: float | None = None
    """Seconds a worker waits for the driver's next average (sync) or the server's answer
    (async). None: sync 2 x round_timeout + 30, so that the driver, not a healthy peer
    waiting on a hung one, reports the hang; async the larger of round_timeout and
    connect_timeout."""

    finish_timeout: float | None = None
    """Seconds the driver waits for the training job to end after its last round; None:
    round_timeout, and for an elastic fit (`min_workers`) at least connect_timeout (a retried
    task still loading its partition must connect to learn that the fit has ended)."""

    max_failures: int = 3
    """Task failures (an exception, a killed worker, a lost executor, a hang) the fit recovers
    from by restarting the training job from its last checkpoint; one more fails the fit."""

    checkpoint_every: int | None = None
    """Sync: every this many rounds (and after the last) the averaged parameters, each worker's
    optimizer state and the position in the data are kept as the restart point and saved to
    `checkpoint_dir` or the MLflow run. None: at the first round starting 30 s or more after
    the last checkpoint (or training's start), so checkpoints cost little however short the
    rounds (`driver.sync.CHECKPOINT_INTERVAL_S`). 0: none; a failure restarts at round 0."""

    checkpoint_dir: str | None = None
    """A directory for checkpoints (the newest two are kept); None: the MLflow run's artifacts
    under checkpoints/."""

    experiment_name: str | None = None
    """MLflow experiment; None uses the active one (MLflow's default, or the notebook's)."""

    run_name: str | None = None
    """MLflow run name; None: one that says what the fit is ("sync-2w-k8",
    "async-dcasgd-4w")."""

    log_model: bool | Literal["adapters"] = True
    """Log the final model so `mlflow.pyfunc` can load it: True the whole model (a PEFT model
    merged into its base), "adapters" only what trained (a PEFT model's adapters), False none."""

    driver_model: Literal["full", "meta"] = "full"
    """"meta": the driver builds `model_fn` on the meta device (shapes and the trainable set,
    no frozen weights) and takes the initial trainable state from an executor's build;
    `FitResult.model` is then built on request. For a backbone too large for the driver."""

    registered_model_name: str | None = None
    """Register the logged model as a new version of this MLflow model (needs log_model);
    `fit` returns once the version is ready."""

    tls_cert: str | None = None
    """Sync: serve the averaging channel over TLS with this certificate (PEM file on the
    driver); workers verify the driver against `tls_ca`, or this certificate when it is
    self-signed. None: plain TCP (HMAC-authenticated, not encrypted)."""

    tls_key: str | None = None
    """Sync: the private key of `tls_cert` (PEM file on the driver)."""

    tls_ca: str | None = None
    """Sync: the CA (PEM file) that signed `tls_cert`; None: `tls_cert` itself."""

    algorithm: str = "downpour"
    """Async: the server's update rule, a name in `ps.rules.RULES`: "downpour", "dcasgd"
    (delay compensation, constant lambda) or "dcasgd-adaptive"."""

    push_every: int = 8
    """Async: local steps between two pushes of a worker's accumulated update."""

    fetch_every: int | None = None
    """Async: local steps between two fetches of the server's parameters (a multiple of
    push_every; None: push_every), at most (staleness_bound + 1) x push_every."""

    staleness_bound: int | None = None
    """Async: no worker runs more than this many pushes ahead of the slowest (0 = lockstep,
    which reproduces sync averaging); None: unbounded."""

    dc_lambda: float | None = None
    """Async DC-ASGD: lambda or, adaptive, lambda0; None: the rule's default (0.04; 2)."""

    ps_address: str | None = None
    """Async: "host:port" of a running `sparkdl-avg ps serve` (with ps_shards > 1, the
    shards' "host:port,host:port,..." in shard order); None: started beside the driver."""

    ps_secret_file: str | None = None
    """Async with ps_address: file holding the server's hex secret."""

    ps_tls_ca: str | None = None
    """Async with ps_address: CA (or the server's self-signed certificate) file; set it to
    speak TLS to a server started with --tls-cert/--tls-key and verify it."""

    eval_interval_s: float = 5.0
    """Async: every this many seconds the driver asks the workers to evaluate the server's
    parameters on their own `eval_df` partitions (and once more on the final ones)."""

    ps_checkpoint_every: int = 10
    """Async: the parameter server saves its state (to `checkpoint_dir`, else a temporary
    folder) every this many pushes per worker; 0: only at the start."""

    reconnect_timeout: float | None = None
    """Async: seconds a worker keeps reconnecting to a parameter server being restarted;
    None: round_timeout."""

    ps_shards: int = 1
    """Async: parameter-server processes, each owning a contiguous slice of the flat
    parameters; workers push and pull the slices in parallel. 1: one server, as before."""

    def __post_init__(self) -> None:
        check_mode(self, _MODES, sync_only=SYNC_ONLY, async_only=ASYNC_ONLY)
        for name in ("num_workers", "epochs", "batch_size", "averaging_frequency", "push_every"):
            require_int(name, getattr(self, name), minimum=1)
        if self.num_workers > MAX_WORKERS:
            raise ConfigError(f"num_workers={self.num_workers}: at most {MAX_WORKERS}")
        for name in ("max_failures", "ps_checkpoint_every", "seed"):
            require_int(name, getattr(self, name), minimum=0)
        for name, least in (("eval_every", 1), ("checkpoint_every", 0), ("eval_batch_size", 1)):
            if getattr(self, name) is not None:
                require_int(name, getattr(self, name), minimum=least)
        check_cache(self, _CACHES)
        if self.driver_address is not None:
            self.driver_host_port()
        if self.checkpoint_dir is not None and (
                not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir):
            raise ConfigError(f"checkpoint_dir must be a directory path, got "
                              f"{self.checkpoint_dir!r}")
        check_choices(self, optimizers=_OPTIMIZERS, devices=_DEVICES, transports=_TRANSPORTS)
        check_async(self)
        check_controls(self)
        check_sync_transport(self)
        check_elastic(self)
        check_averaging(self)
        check_registered_model(self)
        check_flags(self, ("average_optimizer_state", "overlap_averaging", "shuffle",
                           "deterministic", "shared_memory"))

    def default_run_name(self) -> str:
        """What the fit is, for the MLflow runs table."""
        if self.mode == "sync":
            return f"sync-{self.num_workers}w-k{self.averaging_frequency}"
        return f"async-{self.algorithm}-{self.num_workers}w"

    def driver_host_port(self) -> tuple[str | None, int]:
        """`driver_address` as (host or None, port or 0)."""
        return parse_driver_address(self.driver_address)

    def eval_rows(self, feature_bytes: int) -> int:
        """Rows of an evaluation (and scoring) chunk: eval_batch_size as given; by default 16
        batches, and at most 8 MiB of features of `feature_bytes` a row."""
        if self.eval_batch_size is not None:
            return self.eval_batch_size
        return max(1, min(16 * self.batch_size, (8 << 20) // max(1, feature_bytes)))

    def waits(self) -> Waits:
        """Every wait of the fit, the unset ones derived from round_timeout."""
        return waits_of(self)

    def evaluates_first(self, has_eval: bool) -> bool:
        """Whether the fit evaluates before its first step (`eval_before_training`)."""
        return has_eval if self.eval_before_training is None else self.eval_before_training

    def to_dict(self) -> dict[str, str]:
        """Every field as a string, for MLflow params (callables by qualified name; the outer
        optimizer's lr and momentum as they take effect)."""
        from sparkdl_avg.averaging.outer import outer_settings

        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(outer_settings(self))
        out = {}
        for name, value in values.items():
            if callable(value):
                value = getattr(value, "__qualname__", type(value).__name__)
            out[name] = str(value)
        return out
