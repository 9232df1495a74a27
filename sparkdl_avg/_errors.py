"""The errors sparkdl-avg raises, all of them. Every message names what is wrong and says
what to do."""

from __future__ import annotations


class SparkdlAvgError(Exception):
    """Base class of every error raised by sparkdl-avg."""


class ConfigError(SparkdlAvgError, ValueError):
    """A `TrainConfig` field or a `fit` argument has an invalid value."""


class DataError(SparkdlAvgError, ValueError):
    """The training or evaluation DataFrame cannot be used as given."""


class PreprocessError(DataError):
    """`fit(preprocess=)` raised on a batch: final, since a corrupt record fails the same way
    on a retry."""


class ModelError(SparkdlAvgError, ValueError):
    """`model_fn` failed to build, to pickle, or builds a model that does not fit the data."""


class ClusterError(SparkdlAvgError, RuntimeError):
    """The Spark cluster cannot run the fit as configured (too few slots, GPU settings)."""


class DataCacheError(ClusterError):
    """An executor cannot hold a task's data cache: no local directory that exists, is
    writable and has room, or a spill write failed (a full disk)."""


class TrainingError(SparkdlAvgError, RuntimeError):
    """Training failed on an executor, a worker stopped answering, or a checkpoint could not
    be saved."""


REASONS = ("magic", "version", "kind", "oversized", "malformed", "shape", "auth", "role",
           "unexpected", "non_finite", "settings", "timeout", "closed", "capacity", "claimed",
           "ended")
"""Why a peer's message was refused. Servers count refusals by these codes, and an ERROR
reply carries one, so the other side can tell a lost connection from a refusal."""


class ProtocolError(SparkdlAvgError, ConnectionError):
    """A peer sent a frame that is malformed, oversized, unauthenticated or unexpected, or
    refused ours. `reason` is one of `REASONS`."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        if reason not in REASONS:
            raise ValueError(f"unknown protocol error reason {reason!r}")
        self.reason = reason


class PeerClosed(ProtocolError):
    """The peer closed the connection (it ended, crashed or was restarted)."""

    def __init__(self, message: str = "connection closed by the peer") -> None:
        super().__init__(message, "closed")


class Unacceptable(ProtocolError):
    """A whole frame was read but its message is refused: the stream is still in step, so
    a server may answer with a refusal and go on serving the connection."""


class PeerRefused(ProtocolError):
    """The peer answered with an ERROR frame: it refused our request for `reason`."""


def peer_gone(exc: BaseException) -> bool:
    """A socket-level loss (reset, refused, closed, timed out), not a refusal or a protocol
    violation: reconnecting may help."""
    if isinstance(exc, ProtocolError):
        return isinstance(exc, PeerClosed)
    return isinstance(exc, OSError)


class WorkerLostError(TrainingError):
    """Internal: a training task failed, hung or disconnected. The fit restarts from its last
    checkpoint while `max_failures` allows, else reports it as a TrainingError."""

    def __init__(self, message: str, *, partition: int | None = None,
                 reported: str | None = None, host: str | None = None) -> None:
        super().__init__(message)
        self.partition = partition
        self.host = host
        """The task's host as it told the driver, where it did (Connect has no status store
        to ask)."""
        self.reported = reported
        """The exception the worker itself sent (None: a lost socket, a hang, a crash)."""
        self.details: dict | None = None
        """Filled in by the driver: partition, executor, host, error."""
        self.resume_at: str | None = None
        """Where the next attempt takes up, when the failure itself decides it."""


class FinalTaskError(TrainingError):
    """Internal: raised by a training task for an error that a restart would only repeat
    (our own checks: the device, the data changed, a refused update). The driver recognises
    it in Spark's report and fails the fit at once instead of restarting."""


def is_final(exc: BaseException) -> bool:
    """Whether a task's error would repeat on a restart: any of our own errors, except a
    lost connection, a timeout, or a place in the fit that a later attempt of the same task
    took ("ended": Spark ran the task again and that attempt trains)."""
    if not isinstance(exc, SparkdlAvgError) or isinstance(exc, WorkerLostError):
        return False
    return not (isinstance(exc, ProtocolError) and exc.reason in ("closed", "timeout", "ended"))


TASK_ERRORS = (ConfigError, DataError, ModelError, ClusterError)
"""The classes a task's final error keeps on the driver (`from_task`)."""
_TASK_CLASSES = {cls.__name__: cls for cls in (*TASK_ERRORS, DataCacheError, PreprocessError)}


def from_task(where: str, text: str) -> SparkdlAvgError:
    """A task's final error, as its text reached the driver ("DataError: ...", or qualified:
    "sparkdl_avg._errors.DataError: ..."), raised there as the same class: a GPU shared by
    two tasks is a ClusterError wherever it is found. Other errors (a refused update, the
    user's own code) are a TrainingError."""
    name, _, message = text.partition(": ")
    cls = _TASK_CLASSES.get(name.rsplit(".", 1)[-1])
    if cls is None:
        return TrainingError(f"{where} failed: {text}")
    return cls(f"{where} failed: {message}")
