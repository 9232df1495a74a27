"""One dataclass per message kind. Each checks its own fields when built, so whatever a peer
sends is validated once, in one place, before anyone acts on it; a frame that does not fit is
refused with a `ProtocolError` whose reason is "malformed".

`send`, `receive` and `expect` move messages over a `frames.Connection`. A payload (raw
tensor bytes) travels beside a message; `PAYLOAD` says whether a kind must carry one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from sparkdl_avg._errors import REASONS, PeerRefused, ProtocolError, Unacceptable
from sparkdl_avg.net import fields
from sparkdl_avg.net.fields import check_tensor, finite_or_none, into_checked, tensor  # noqa: F401
from sparkdl_avg.net.frames import Connection, Kind

M = TypeVar("M", bound="Message")
MAX_WORKERS = 4096
MAX_FINISHED_WAIT_S = 60.0


@dataclass(frozen=True, slots=True)
class Message:
    """Fields are checked against their annotations (int, float, bool, str, dict, list and
    `| None`; floats finite, integers within `MAX_NUMBER`), then by the kind's own
    `check`."""

    KIND: ClassVar[Kind | None] = None
    PAYLOAD: ClassVar[bool | None] = False
    """True: must carry a payload; False: must not; None: may."""

    def __post_init__(self) -> None:
        for name, expected in fields.hints(type(self)).items():
            value = getattr(self, name)
            if not fields.matches(value, expected):
                raise ProtocolError(f"{type(self).__name__}.{name} must be "
                                    f"{fields.type_name(expected)}, got {value!r}"[:500])
        self.check()

    def check(self) -> None:
        """Checks beyond the types (ranges, codes); raise `invalid(...)`."""

    def invalid(self, why: str) -> ProtocolError:
        return ProtocolError(f"malformed {type(self).__name__}: {why}"[:500])

    def to_meta(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_meta(cls: type[M], meta: dict[str, Any]) -> M:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(meta) - names)
        if unknown:
            raise ProtocolError(f"{cls.__name__} has no fields {unknown}"[:500])
        try:
            return cls(**meta)
        except TypeError as exc:  # a required field is missing
            raise ProtocolError(f"malformed {cls.__name__}: {exc}"[:500]) from None


# --- the handshake (see `auth`) ----------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Challenge(Message):
    KIND = Kind.CHALLENGE
    nonce: str

    def check(self) -> None:
        fields.hex_string("nonce", self.nonce, self)


@dataclass(frozen=True, slots=True)
class Auth(Message):
    KIND = Kind.AUTH
    nonce: str
    mac: str
    hello: dict
    """The client's introduction (`WorkerHello`, `ServerHello`), covered by the MAC."""

    def check(self) -> None:
        fields.hex_string("nonce", self.nonce, self)
        fields.hex_string("mac", self.mac, self)


@dataclass(frozen=True, slots=True)
class Welcome(Message):
    KIND = Kind.WELCOME
    mac: str

    def check(self) -> None:
        fields.hex_string("mac", self.mac, self)


@dataclass(frozen=True, slots=True)
class Refusal(Message):
    """A request refused: why, and a code from `_errors.REASONS`."""

    KIND = Kind.ERROR
    message: str
    reason: str = "malformed"

    def check(self) -> None:
        if self.reason not in REASONS:
            raise self.invalid(f"unknown reason {self.reason!r}")


# --- synchronous averaging: a worker and the driver's coordinator ------------------------

@dataclass(frozen=True, slots=True)
class WorkerHello(Message):
    """A sync worker introduces itself in its AUTH: its partition, its host (for the driver's
    messages) and its device ("cpu" or "cuda/<GPU name>", which checkpoints record)."""

    rank: int
    host: str
    device: str = "cpu"

    def check(self) -> None:
        if self.rank < 0:
            raise self.invalid(f"rank {self.rank}")


@dataclass(frozen=True, slots=True)
class Push(Message):
    """A worker's parameters (and optimizer state, when averaged) after a round's steps."""

    KIND = Kind.PUSH
    PAYLOAD = True
    round: int
    samples: int
    loss_sum: float | None
    """None: not finite."""
    compute_s: float
    setup_s: float
    dtype: str
    numel: int

    def check(self) -> None:
        if self.round < 0 or self.samples < 1:
            raise self.invalid("round >= 0 and samples >= 1 are required")
        fields.durations(self, "compute_s", "setup_s")
        fields.payload_description(self)


@dataclass(frozen=True, slots=True)
class Average(Message):
    """The driver's average. The first one (round = the round before the first to run) is
    where training starts; `state_follows`: a STATE with the worker's optimizer state
    follows (a restart). Later ones say what the worker sends after it."""

    KIND = Kind.AVERAGE
    PAYLOAD = True
    round: int
    dtype: str
    numel: int
    evaluate: bool = False
    checkpoint: bool = False
    state_follows: bool = False

    def check(self) -> None:
        if self.round < -1:
            raise self.invalid(f"round {self.round}")
        fields.payload_description(self)


@dataclass(frozen=True, slots=True)
class State(Message):
    """A worker's optimizer state and integer buffers (`task.worker_state`), either way."""

    KIND = Kind.STATE
    PAYLOAD = None
    layout: list


@dataclass(frozen=True, slots=True)
class Eval(Message):
    """A worker's evaluation of its rows (loss_sum None: not finite; correct None: no
    classifier), to the driver (sync) or to the server for its `request` (async)."""

    KIND = Kind.EVAL
    loss_sum: float | None
    correct: int | None
    count: int
    eval_s: float
    request: int | None = None

    def check(self) -> None:
        if self.count < 0 or (self.correct is not None and not 0 <= self.correct <= self.count):
            raise self.invalid(f"count {self.count}, correct {self.correct}")
        fields.request_id(self, self.request)
        fields.durations(self, "eval_s")


@dataclass(frozen=True, slots=True)
class Done(Message):
    """The worker ran its last round. Its integer buffers (BatchNorm's `num_batches_tracked`:
    never averaged) follow as payload, in `task.worker_state`'s layout."""

    KIND = Kind.DONE
    PAYLOAD = None
    layout: list


@dataclass(frozen=True, slots=True)
class WorkerFailed(Message):
    """A worker's own error. `final`: a restart would repeat it (our own checks)."""

    KIND = Kind.FAILED
    message: str
    final: bool = False


# --- the parameter server ----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ServerHello(Message):
    """A parameter-server client introduces itself in its AUTH; -1 is the driver."""

    worker: int

    def check(self) -> None:
        if not -1 <= self.worker < MAX_WORKERS:
            raise self.invalid(f"worker id {self.worker}")


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

    def check(self) -> None:
        if not 0 <= self.workers <= MAX_WORKERS:
            raise self.invalid(f"workers {self.workers}")
        fields.payload_description(self)


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

    def check(self) -> None:
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

    def check(self) -> None:
        fields.request_id(self, self.evaluate)


@dataclass(frozen=True, slots=True)
class Stats(Message):
    """Asked for with no report; answered with the server's counters (also to EVALUATE)."""

    KIND = Kind.STATS
    report: dict | None = None


@dataclass(frozen=True, slots=True)
class Evaluate(Message):
    """The driver asks the workers to evaluate the server's current parameters: the server
    keeps a copy under a new request id, which its STATS answer (taken at the same moment)
    names under evaluations.pending."""

    KIND = Kind.EVALUATE


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


MESSAGES: dict[Kind, type[Message]] = {
    cls.KIND: cls for cls in Message.__subclasses__() if cls.KIND is not None}


# --- over a connection -------------------------------------------------------------------

def send(conn: Connection, message: Message, payload: Any = None) -> None:
    conn.send(message.KIND, message.to_meta(), payload)


def receive(conn: Connection, into=None) -> tuple[Message, memoryview | None]:
    """The next message and its payload. `into`: an array for the payload, or a function of
    the decoded message returning one (None: a fresh buffer within the connection's limit).
    The message is validated before a byte of its payload is read."""
    decoded: list[Message] = []

    def target(kind: Kind, meta: dict) -> Any:  # an array for the payload, or None
        decoded.append(decode(kind, meta))
        return into(decoded[0]) if callable(into) else into

    frame = conn.recv(target)
    if decoded:
        message = decoded[0]
    else:
        try:
            message = decode(frame.kind, frame.meta)
        except ProtocolError as exc:
            raise Unacceptable(str(exc), exc.reason) from None
    if message.PAYLOAD is True and frame.payload is None:
        raise Unacceptable(f"{message.KIND.name} without a payload")
    if message.PAYLOAD is False and frame.payload is not None:
        raise Unacceptable(f"{message.KIND.name} with an unexpected payload")
    return message, frame.payload


def expect(conn: Connection, cls: type[M], into=None) -> tuple[M, memoryview | None]:
    """Receive a `cls`; a `Refusal` raises `PeerRefused` with its reason."""
    message, payload = receive(conn, into)
    if isinstance(message, Refusal):
        raise PeerRefused(f"the peer refused: {message.message}", message.reason)
    if not isinstance(message, cls):
        raise ProtocolError(f"expected {cls.KIND.name}, got {message.KIND.name}", "unexpected")
    return message, payload


def decode(kind: Kind, meta: dict) -> Message:
    cls = MESSAGES.get(kind)
    if cls is None:
        raise ProtocolError(f"no message of kind {kind.name}", "kind")
    return cls.from_meta(meta)
