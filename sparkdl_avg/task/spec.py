"""What a training task receives: plain picklable values, no SparkSession, no sockets."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparkdl_avg.data.schema import DataSchema
from sparkdl_avg.task.schedule import Schedule


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    address: tuple[str, int]
    """Where to connect: the driver's coordinator (sync) or the parameter server (async)."""
    config: bytes
    """The TrainConfig, cloudpickled like model_fn (so a callable optimizer from the user's own
    module travels by value)."""
    model_fn: bytes
    loss: bytes
    """The objective (`_losses.Objective`), cloudpickled: a user's loss travels in it."""
    schedule: Schedule
    schema: DataSchema
    """Every input, label and weight: carried dtype and row shape."""
    train_rows: list[int]
    eval_rows: list[int]
    """Rows per partition as validation counted them; a task that gets others stops."""
    num_workers: int = 1
    ragged_values: dict[str, float] = field(default_factory=dict)
    """Per ragged field (by wire): values per row on average, for sizing the cache."""
    longest: dict[str, int] = field(default_factory=dict)
    """Per ragged field (by wire): its longest row, for sizing evaluation chunks."""
    model_dtype: str = "float32"
    """The model's parameter dtype (a torch dtype's name): the memory cache holds features in
    it, so the device keeps one copy of the partition."""
    load_monitor: tuple[str, int] | None = None
    """Where to claim this task's worker key (`task.enrolment`) and report loading progress
    (`driver.load_monitor`), with `load_secret`: the launch's own secret, not the
    coordinator's or the parameter server's. Spark hands every task of a barrier job the same
    closure, so no worker key travels here (see docs/guide/security.md)."""
    load_secret: bytes = field(default=b"", repr=False)
    tls_ca_pem: str | None = None
    """PEM text that verifies the driver's coordinator (sync) or the parameter server
    (async) over TLS; None: plain TCP."""
    gpu_tasks: bool = True
    """Whether Spark gives the training tasks GPUs (a task GPU amount or a training resource
    profile). Only then can two tasks be handed one GPU, and only then do they compare their
    GPUs with a barrier all-gather, which costs about a second: Spark polls its barrier once a
    second."""
    frozen: dict | None = None
    """The frozen tensors' fingerprint (`averaging.frozen.Fingerprint.to_dict`) of the
    driver's build, or of the executor's that gave the initial state: each replica's build
    must match it. None: not checked."""
    preprocess: bytes | None = None
    """`fit(preprocess=)`, cloudpickled; None: the cache's rows go to the model as they are."""
    model_schema: DataSchema | None = None
    """With `preprocess`: the fields the model gets (what preprocess returned for the
    driver's sample); `schema` stays what is carried and cached."""
    build_warnings: tuple[str, ...] = ()
    """What the driver's build of model_fn warned of (shown there): a task's build keeps
    these to itself, and reports only others (`_model.heard_warnings`)."""
    ps_shards: tuple[tuple[str, int], ...] = ()
    """Async with several parameter-server shards: their addresses in shard order (the
    first is `address`); empty: one server at `address`."""

    def ps_addresses(self) -> list[tuple[str, int]]:
        return list(self.ps_shards) or [self.address]

    def shape(self, rank: int):
        """What worker `rank` knows of its partition before reading it."""
        from sparkdl_avg.data.partition import Shape

        return Shape(rank=rank, num_workers=self.num_workers, train_rows=self.train_rows[rank],
                     eval_rows=self.eval_rows[rank], schema=self.schema,
                     ragged_values=self.ragged_values)
