"""One dataclass per message kind. Each checks its own fields when built, so whatever a peer
sends is validated once, in one place, before anyone acts on it; a frame that does not fit is
refused with a `ProtocolError` whose reason is "malformed".

The parameter server's kinds live in `ps_messages` and are re-exported here, so every kind is
`messages.<Name>`. `send`, `receive` and `expect` move messages over a `frames.Connection`. A
payload (raw tensor bytes) travels beside a message; `PAYLOAD` says whether a kind must carry
one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sparkdl_avg._errors import REASONS, PeerRefused, ProtocolError, Unacceptable
from sparkdl_avg.net import fields
from sparkdl_avg.net.fields import (  # noqa: F401
    check_tensor,
    finite_or_none,
    into_checked,
    into_encoded,
    tensor,
)
from sparkdl_avg.net.frames import Connection, Kind
from sparkdl_avg.net.message_base import MAX_FINISHED_WAIT_S, MAX_WORKERS, M, Message  # noqa: F401
from sparkdl_avg.net.ps_messages import (  # noqa: F401
    MAX_ERROR_CHARS,
    Ack,
    Evaluate,
    Finished,
    Init,
    Params,
    Pull,
    ServerHello,
    Settings,
    Stats,
    Stop,
    Update,
)

# --- the handshake (see `auth`) ----------------------------------------------------------

ROLE = re.compile(r"driver|worker:(0|[1-9][0-9]{0,5})")
"""The roles a client may claim in its AUTH (`auth.role_key`)."""


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
    role: str
    """The role whose key made `mac` (`ROLE`): "driver" or "worker:<id>"."""
    hello: dict
    """The client's introduction (`WorkerHello`, `ServerHello`), covered by the MAC."""

    def check(self) -> None:
        fields.hex_string("nonce", self.nonce, self)
        fields.hex_string("mac", self.mac, self)
        if not ROLE.fullmatch(self.role):
            raise self.invalid(f"role {self.role[:40]!r}")


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


@dataclass(frozen=True, slots=True)
class Enrolled(Message):
    """The load monitor's answer to a task's claim (`task.enrolment`): the task's worker key,
    sealed under a pad that only a holder of the launch's secret can make from `nonce`."""

    KIND = Kind.KEY
    nonce: str
    sealed: str

    def check(self) -> None:
        fields.hex_string("nonce", self.nonce, self)
        fields.hex_string("sealed", self.sealed, self)
        if len(self.sealed) != 64 or len(self.nonce) != 64:
            raise self.invalid(f"a sealed key of {len(self.sealed) // 2} bytes, a nonce of "
                               f"{len(self.nonce) // 2}")


# --- synchronous averaging: a worker and the driver's coordinator ------------------------

@dataclass(frozen=True, slots=True)
class WorkerHello(Message):
    """A sync worker introduces itself in its AUTH: its partition, its host (for the driver's
    messages) and its device ("cpu" or "cuda/<GPU name>", which checkpoints record)."""

    rank: int
    host: str
    device: str = "cpu"
    attempt: int = 0
    """Spark's attempt number of the task (an elastic fit's records say which came back)."""
    shared: str = ""
    """The worker's shared-memory region for its pushes (`net.shared_memory`), if it made
    one; "" if none."""

    def check(self) -> None:
        if self.rank < 0 or self.attempt < 0:
            raise self.invalid(f"rank {self.rank}, attempt {self.attempt}")
        fields.region_name(self)


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
    lr: float | None = None
    """The learning rate of the round's last optimizer step."""
    encoding: str = "none"
    """"none": the parameters; else the worker's delta from the global parameters,
    compressed so (`averaging.compression`)."""
    shared_down: bool = False
    """The worker has mapped the driver's region (named in the first AVERAGE): averages may
    come through it."""

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
    stop: bool = False
    """Early stopping: the fit ends here; the worker sends DONE."""
    wait_next: bool = False
    """With overlap_averaging: the next round evaluates or checkpoints, so after its push
    the worker waits for its average instead of computing on."""
    encoding: str = "none"
    """"none": the new global parameters; else the update to subtract from them,
    compressed so (`averaging.compression`)."""
    global_follows: bool = False
    """The collective transport's restart: a STATE with the outer optimizer's state (and
    the update's residual) follows the worker's own (`averaging.global_step`)."""
    shared: str = ""
    """The first AVERAGE: the driver's region that later averages may come through, if the
    worker can map it ("" if none)."""
    shared_up: bool = False
    """The first AVERAGE: the driver has mapped the region named in the worker's hello, so
    its pushes may go through it."""

    def check(self) -> None:
        if self.round < -1:
            raise self.invalid(f"round {self.round}")
        fields.payload_description(self)
        fields.region_name(self)


@dataclass(frozen=True, slots=True)
class State(Message):
    """A worker's optimizer state and integer buffers (`task.worker_state`), either way."""

    KIND = Kind.STATE
    PAYLOAD = None
    layout: list


@dataclass(frozen=True, slots=True)
class Eval(Message):
    """A worker's evaluation of its rows, to the driver (sync) or to the server for its
    `request` (async). Sums that add up over workers: the eval loss is sum(loss_sum) /
    sum(loss_weight), the accuracy sum(correct) / sum(scored) (`_losses.EvalSums`)."""

    KIND = Kind.EVAL
    PAYLOAD = None
    """The score tables of `ranked`, float64 rows (score, positive, negative weight)."""
    loss_sum: float | None
    """None: not finite."""
    loss_weight: float
    """The weight of the elements the loss kept (rows, tokens not labelled -100, ...)."""
    correct: int | None
    """None: no output is scored for accuracy, and then `scored` is None too."""
    scored: int | None
    """The predictions scored: rows, tokens kept, or labels of a multi-label output."""
    count: int
    """Rows evaluated."""
    eval_s: float
    request: int | None = None
    metrics: dict | None = None
    """Per metric (`_metrics`), its sums that add over workers (None: not finite)."""
    ranked: dict | None = None
    """Per ranking metric (auc), the rows of its score table in the payload, in order
    (`_eval_sums`)."""

    def check(self) -> None:
        fields.metric_fields(self, self.metrics, self.ranked)
        if self.count < 0 or self.loss_weight < 0:
            raise self.invalid(f"count {self.count}, loss_weight {self.loss_weight}")
        if (self.correct is None) != (self.scored is None) or (
                self.correct is not None and not 0 <= self.correct <= self.scored):
            raise self.invalid(f"scored {self.scored}, correct {self.correct}")
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


# --- the collective transport: the tasks all-reduce; the driver keeps the control plane ---

@dataclass(frozen=True, slots=True)
class Report(Message):
    """A worker's round, after the all-reduce among the tasks: what a `Push` says, without
    the parameters, plus how far its replica was from the average and what was finite."""

    KIND = Kind.REPORT
    round: int
    samples: int
    loss_sum: float | None
    compute_s: float
    setup_s: float
    reduce_s: float
    """The all-reduce's time, as this worker measured it."""
    distance: float | None
    """The L2 distance of this replica from the average (None: not finite)."""
    replica_finite: bool
    average_finite: bool
    lr: float | None = None
    outer_norm: float | None = None
    """The outer optimizer's step, G_old - G_new, in L2 norm (None: no outer step)."""

    def check(self) -> None:
        if self.round < 0 or self.samples < 1:
            raise self.invalid("round >= 0 and samples >= 1 are required")
        fields.durations(self, "compute_s", "setup_s", "reduce_s")
        for name in ("distance", "outer_norm"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise self.invalid(f"{name} {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Orders(Message):
    """The driver's answer to a round's reports: what the workers do after it, and whether
    worker 0 sends the average (an `Averaged`) first."""

    KIND = Kind.ORDERS
    round: int
    evaluate: bool = False
    checkpoint: bool = False
    stop: bool = False
    send_average: bool = False
    wait_next: bool = False
    """As `Average.wait_next`."""

    def check(self) -> None:
        if self.round < 0:
            raise self.invalid(f"round {self.round}")


@dataclass(frozen=True, slots=True)
class Averaged(Message):
    """Worker 0's copy of a round's average, when the driver needs it (checkpoints, early
    stopping, the end)."""

    KIND = Kind.AVERAGED
    PAYLOAD = True
    round: int
    dtype: str
    numel: int

    def check(self) -> None:
        if self.round < 0:
            raise self.invalid(f"round {self.round}")
        fields.payload_description(self)


MESSAGES: dict[Kind, type[Message]] = {
    cls.KIND: cls for cls in Message.__subclasses__() if cls.KIND is not None}


# --- over a connection -------------------------------------------------------------------

def send(conn: Connection, message: Message, payload: Any = None) -> None:
    conn.send(message.KIND, message.to_meta(), payload)


def receive(conn: Connection, into=None) -> tuple[Message, memoryview | None]:
    """The next message and its payload. `into`: an array for the payload, or a function of
    the decoded message returning one (None: a fresh buffer within the connection's limit).
    The message is validated before a byte of its payload is read, and a payload where its
    kind has none is refused unread (a PULL cannot make a server buffer gigabytes)."""
    decoded: list[Message] = []

    def target(kind: Kind, meta: dict) -> Any:  # an array for the payload, or None
        decoded.append(decode(kind, meta))
        if decoded[0].PAYLOAD is False:  # refused before a byte of it is read
            raise ProtocolError(f"{kind.name} carries no payload; this one claims one",
                                "oversized")
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
