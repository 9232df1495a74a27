"""The parameter server's messages (async mode): the driver's INIT, EVALUATE and STOP, and
every worker's PULL, UPDATE, EVAL and FINISHED with the server's answers. Registered, sent and
received with the rest through `messages`."""

from __future__ import annotations

from dataclasses import dataclass

from sparkdl_avg.net import fields
from sparkdl_avg.net.frames import Kind
from sparkdl_avg.net.message_base import (
    MAX_ERROR_CHARS,
    MAX_FINISHED_WAIT_S,
    MAX_WORKERS,
    Message,
)


@dataclass(frozen=True, slots=True)
class ServerHello(Message):
    """A parameter-server client introduces itself in its AUTH; -1 is the driver."""

    worker: int
    attempt: int = 0
    """A worker task's Spark task attempt id (unique in the application, later attempts
    higher): the server serves a worker id's latest attempt only."""

    def check(self) -> None:
        if not -1 <= self.worker < MAX_WORKERS or self.attempt < 0:
            raise self.invalid(f"worker id {self.worker}, attempt {self.attempt}")


@dataclass(frozen=True, slots=True)
class Init(Message):
    """The driver (re)starts the server from the payload's parameters, expecting workers
    0..workers-1, and names the settings the fit needs the server to have."""

    KIND = Kind.INIT
    PAYLOAD = True
    dtype: str
    numel: int
    workers: int
    expect: dict
    gradients: int | None = None
    """The leading values a gradient moves (the trainable parameters); the rest are
    statistics (`ps.rules`). None: all."""

    def check(self) -> None:
        if not 0 <= self.workers <= MAX_WORKERS:
            raise self.invalid(f"workers {self.workers}")
        fields.payload_description(self)
        if self.gradients is not None and not 0 <= self.gradients <= self.numel:
            raise self.invalid(f"gradients {self.gradients} of {self.numel} values")


@dataclass(frozen=True, slots=True)
class Settings(Message):
    """The server's answer to INIT: its settings (`ps.settings.ServerSettings.to_dict`)."""

    KIND = Kind.SETTINGS
    settings: dict


@dataclass(frozen=True, slots=True)
class Pull(Message):
    KIND = Kind.PULL
    evaluate: bool = False
    """The snapshot of the request in `Ack.evaluate`: no read for the staleness bound."""


@dataclass(frozen=True, slots=True)
class Params(Message):
    """The server's parameters; `progress`: the puller's steps the server has applied."""

    KIND = Kind.PARAMS
    PAYLOAD = True
    version: int
    """The updates applied to these parameters."""
    progress: int
    dtype: str
    numel: int
    evaluate: int | None = None
    """The evaluation request these parameters are the snapshot of; None: the current ones."""

    def check(self) -> None:
        fields.request_id(self, self.evaluate)
        fields.payload_description(self)


@dataclass(frozen=True, slots=True)
class Update(Message):
    """A worker's accumulated update (w <- w - update by the server's rule). `steps`: the
    worker's local steps including this update (where it resumes after a restart)."""

    KIND = Kind.UPDATE
    PAYLOAD = True
    dtype: str
    numel: int
    samples: int = 0
    loss_sum: float | None = 0.0
    """None: not finite."""
    steps: int | None = None
    lr: float | None = None
    """The mean learning rate of the update's steps (DC-ASGD's g = update / lr); None: the
    server's lr."""

    def check(self) -> None:
        if self.lr is not None and self.lr < 0:
            raise self.invalid(f"lr {self.lr}")
        if self.samples < 0 or (self.steps is not None and self.steps < 0):
            raise self.invalid(f"samples {self.samples}, steps {self.steps}")
        fields.payload_description(self)


@dataclass(frozen=True, slots=True)
class Ack(Message):
    """The server's answer to an UPDATE, an EVAL or a FINISHED."""

    KIND = Kind.ACK
    applied: int
    """The updates the server has applied."""
    staleness: int = 0
    """Of the acknowledged update: updates applied since the worker last pulled."""
    evaluate: int | None = None
    """An evaluation request the worker has yet to answer (`Pull(evaluate=True)`, EVAL)."""
    done: bool = False
    """To a FINISHED: the worker has answered the final evaluation (or none will come)."""
    stop: bool = False
    """To an UPDATE: the driver ended training early (early stopping); push no more."""

    def check(self) -> None:
        fields.request_id(self, self.evaluate)


@dataclass(frozen=True, slots=True)
class Stats(Message):
    """Asked for with no report; answered with the server's counters (also to EVALUATE)."""

    KIND = Kind.STATS
    report: dict | None = None
    checkpoint_error: str | None = None
    """In an answer: the first of the server's checkpoint saves that failed since the fit's
    INIT ("could not save the server checkpoint <file>: <error>"); None while all succeed.
    The server goes on serving; the driver fails the fit (a crash could not be recovered)."""

    def check(self) -> None:
        if self.checkpoint_error is not None and \
                not 0 < len(self.checkpoint_error) <= MAX_ERROR_CHARS:
            raise self.invalid(f"checkpoint_error of {len(self.checkpoint_error)} characters "
                               f"(1 to {MAX_ERROR_CHARS})")


@dataclass(frozen=True, slots=True)
class Evaluate(Message):
    """The driver asks the workers to evaluate the server's current parameters: the server
    keeps a copy under a new request id, which its STATS answer (taken at the same moment)
    names under evaluations.pending."""

    KIND = Kind.EVALUATE


@dataclass(frozen=True, slots=True)
class Stop(Message):
    """The driver ends training early (early stopping): from now on every ACK to an UPDATE
    says stop, and the workers go on as if they had pushed their last. Answered with STATS."""

    KIND = Kind.STOP


@dataclass(frozen=True, slots=True)
class Finished(Message):
    """A worker has pushed its last update and waits for evaluation requests, up to the
    final one (made once every worker is finished). The server holds the answer (an ACK)
    for up to `wait_s` seconds until there is a request for it or it may end."""

    KIND = Kind.FINISHED
    wait_s: float

    def check(self) -> None:
        fields.durations(self, "wait_s")
        if self.wait_s > MAX_FINISHED_WAIT_S:
            raise self.invalid(f"wait_s={self.wait_s} exceeds {MAX_FINISHED_WAIT_S:g}")
