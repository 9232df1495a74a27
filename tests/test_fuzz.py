"""Property-based fuzzing of both servers: at least 10,000 mutated frames each, before and
after authentication. Whatever arrives, no handler crashes, nothing unauthenticated is
applied, every refusal is counted, and the server keeps serving."""

from __future__ import annotations

import json
import logging
import socket
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from sparkdl_avg._errors import REASONS, PeerRefused
from sparkdl_avg.averaging.coordinator import Coordinator
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.auth import authenticate_to_server
from sparkdl_avg.net.frames import HEADER, MAGIC, VERSION, Connection, Kind
from sparkdl_avg.ps.client import PSClient
from sparkdl_avg.ps.rules import RULES, make_rule
from sparkdl_avg.ps.server import DRIVER, ParameterServer
from sparkdl_avg.ps.settings import ServerSettings

SECRET = b"f" * 32
EXAMPLES = 10_000
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


def frame(kind: int, meta: dict, payload: bytes = b"") -> bytes:
    body = json.dumps(meta).encode()
    return HEADER.pack(MAGIC, VERSION, kind, 0, len(body), len(payload)) + body + payload


AUTH = frame(Kind.AUTH, {"nonce": "ab" * 32, "mac": "cd" * 32, "hello": {"worker": 0}})
AFTER_AUTH = [
    frame(Kind.PULL, {}),
    frame(Kind.UPDATE, {"dtype": "float32", "numel": 4, "samples": 2, "loss_sum": 1.0,
                        "steps": 3}, np.ones(4, np.float32).tobytes()),
    frame(Kind.STATS, {"report": None}),
    frame(Kind.INIT, {"dtype": "float32", "numel": 4, "workers": 2, "expect": {}},
          np.zeros(4, np.float32).tobytes()),
    frame(Kind.PUSH, {"round": 0}),
    frame(Kind.EVALUATE, {}),
    frame(Kind.PULL, {"evaluate": True}),
    frame(Kind.EVAL, {"loss_sum": 1.0, "loss_weight": 2.0, "correct": 1, "scored": 2,
                      "count": 2, "eval_s": 0.1, "request": 0}),
    frame(Kind.FINISHED, {"wait_s": 0.05}),
]
HELLOS = st.fixed_dictionaries({}, optional={
    "worker": st.one_of(st.integers(-5, 10), st.integers(), st.booleans(), st.none(),
                        st.text(max_size=3)),
    "rank": st.one_of(st.integers(-5, 10), st.integers(), st.floats(), st.text(max_size=3)),
    "host": st.one_of(st.text(max_size=20), st.integers(), st.none()),
    "extra": st.just(1)})


@st.composite
def mutated(draw, bases: list[bytes]) -> bytes:
    data = bytearray(draw(st.sampled_from(bases)))
    for _ in range(draw(st.integers(0, 4))):
        how = draw(st.sampled_from(["flip", "cut", "insert", "header"]))
        if how == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
        elif how == "cut":
            del data[draw(st.integers(0, len(data))):]
        elif how == "insert":
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(max_size=16))
        elif len(data) >= HEADER.size:  # lengths that lie
            meta_len = draw(st.integers(0, 1 << 32 - 1))
            payload_len = draw(st.integers(0, 1 << 63))
            data[12:24] = struct.pack("!IQ", meta_len, payload_len)
    return bytes(data)


def send_and_read(address, payload: bytes, hello: dict | None, secret: bytes = SECRET) -> None:
    """Connect (authenticating with `hello` when given), send `payload`, read what comes
    back until the server closes or goes quiet."""
    with socket.create_connection(address, timeout=5) as sock:
        conn = Connection(sock, timeout=0.5, max_payload=1 << 16)
        try:
            if hello is None:
                msg.expect(conn, msg.Challenge)
            else:
                authenticate_to_server(conn, secret, _Hello(hello))
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            while conn.recv(None).kind is not Kind.ERROR:
                pass
        except (OSError, ValueError):  # refused, closed, or quiet: all fine here
            pass


class _Hello(msg.Message):
    """Any hello at all, to reach the servers' own checks of it."""

    __slots__ = ("meta",)

    def __init__(self, meta: dict) -> None:
        object.__setattr__(self, "meta", meta)

    def to_meta(self) -> dict:
        return self.meta


@pytest.fixture
def handler_errors(caplog):
    caplog.set_level(logging.ERROR, logger="sparkdl_avg")
    yield lambda: [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_parameter_server_survives_mutated_frames(handler_errors):
    rule = make_rule("downpour", np.zeros(4, np.float32))
    ps = ParameterServer(ServerSettings(timeout=5), secret=SECRET, rule=rule)
    sent = []

    @FUZZ
    @seed(20261122)
    @given(st.data())
    def fuzz(data):
        if data.draw(st.booleans()):  # a stranger
            payload = data.draw(mutated([AUTH]))
            send_and_read(ps.address, payload, None)
        else:  # a peer with the secret, saying odd things
            payload = data.draw(mutated(AFTER_AUTH))
            send_and_read(ps.address, payload, data.draw(HELLOS))
        sent.append(payload)

    with ps:
        before = rule.params.copy()
        fuzz()
        assert len(sent) >= EXAMPLES
        assert ps.failure is None and handler_errors() == []
        assert sum(ps.stats()["refused"].values()) > EXAMPLES // 4
        assert ps.rule is rule or ps.rule.params.shape == before.shape
        with PSClient(ps.address, secret=SECRET, worker=1, numel=ps.rule.params.size,
                      dtype=ps.rule.params.dtype, timeout=5) as c:
            c.pull()  # still serving


WORKER_FRAMES = [
    frame(Kind.PUSH, {"round": 0, "samples": 4, "loss_sum": 2.0, "compute_s": 0.1,
                      "setup_s": 0.0, "dtype": "float32", "numel": 4},
          np.ones(4, np.float32).tobytes()),
    frame(Kind.EVAL, {"loss_sum": 1.0, "loss_weight": 2.0, "correct": 1, "scored": 2,
                      "count": 2, "eval_s": 0.1}),
    frame(Kind.STATE, {"layout": [[0, "step", "value", 1]]}),
    frame(Kind.DONE, {"layout": []}),
    frame(Kind.FAILED, {"message": "boom", "final": False}),
]


def test_the_coordinator_survives_mutated_frames(handler_errors):
    """Strangers over the network; and a worker's frames (PUSH, EVAL, STATE, DONE, FAILED)
    read by the coordinator's own receive path as a round would read them."""
    from sparkdl_avg._errors import SparkdlAvgError

    coord = Coordinator(host="127.0.0.1", advertise="127.0.0.1", num_workers=1,
                        secret=SECRET, timeout=1, dtype=np.float32, model_numel=4,
                        check_job=lambda wait: None)
    coord.hellos[0] = msg.WorkerHello(rank=0, host="fuzz")
    sent, outcomes = [], {}

    def as_a_round_reads_it(payload: bytes) -> str:
        a, b = socket.socketpair()
        conn = Connection(b, timeout=0.2, max_payload=1 << 16)
        try:
            a.sendall(payload)
            a.shutdown(socket.SHUT_WR)
            kind = payload[5] if len(payload) > 5 else 0
            if kind == Kind.PUSH:
                coord._recv_push(0, conn, 0, model_numel=4, allow_state=False)
            else:
                coord._expect(0, conn, msg.Eval if kind == Kind.EVAL else
                              msg.State if kind == Kind.STATE else msg.Done)
            return "accepted"
        except SparkdlAvgError as exc:  # lost, refused or failed: the fit's own errors
            return type(exc).__name__
        finally:
            a.close()
            conn.close()

    @FUZZ
    @seed(20261123)
    @given(st.data())
    def fuzz(data):
        if data.draw(st.booleans()):
            payload = data.draw(mutated([AUTH]))
            send_and_read(coord.address, payload, None)
        else:
            payload = data.draw(mutated(WORKER_FRAMES))
            outcome = as_a_round_reads_it(payload)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        sent.append(payload)

    with coord:
        fuzz()
        assert len(sent) >= EXAMPLES
        assert coord.failure is None and handler_errors() == []
        assert sum(coord.refused.values()) > EXAMPLES // 4
        assert {"accepted", "WorkerLostError"} <= set(outcomes)  # both ways were reached
        send_and_read(coord.address, AUTH, None)  # still accepting and answering


EXTREMES = st.sampled_from([0.0, 1e-45, -1e-38, 1.0, -2.5, 1e30, 3e38, -3.4e38, 1.7e308])
"""Finite values at the edges of float32's range and float64's (cast into float32, 1.7e308 is
its largest finite value instead: `finite_array`)."""
LRS = st.sampled_from([None, 0.0, 1e-300, 1e-38, 0.1, 1e30, 1e308])
PUSH = st.tuples(
    st.just("push"), st.sampled_from([0, 1, 0, 1, "driver"]),  # the driver: refused
    st.sampled_from([True, True, False]),  # pull first: most DC-ASGD pushes are then taken
    st.lists(EXTREMES, min_size=4, max_size=4), LRS,
    st.sampled_from([0.0, -1e308, 1.7e308]), st.sampled_from([0, 1, 2 ** 52, 2 ** 53]))
STEPS = st.one_of(
    st.tuples(st.just("init"), st.lists(EXTREMES, min_size=4, max_size=4),
              st.sampled_from([0, 3])),
    st.tuples(st.just("pull"), st.integers(0, 1)),
    PUSH, PUSH,  # pushes twice as often as the other steps
    st.tuples(st.just("finished"), st.integers(0, 1)),
    st.tuples(st.just("evaluate"),))


def finite_array(values: list[float], dtype: str) -> np.ndarray:
    """`values` in `dtype`, each clipped to its finite range (a cast would make Inf)."""
    largest = float(np.finfo(dtype).max)
    return np.array(np.clip(values, -largest, largest), dtype)


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@seed(20261126)
@given(algorithm=st.sampled_from(sorted(RULES)), dtype=st.sampled_from(["float32", "float64"]),
       bound=st.sampled_from([None, 1000]), steps=st.lists(STEPS, max_size=12))
def test_authenticated_sequences_of_extreme_finite_values(algorithm, dtype, bound, steps):
    """Inits, pulls, pushes (updates, lrs, losses and sample counts at the edges of their
    ranges; the driver's too) and FINISHED, in any order, from authenticated peers. After
    every step the parameters an honest worker (2) pulls are finite, every refusal carries a
    reason and is counted, and no connection is dropped. Half the runs have a staleness
    bound, one no sequence reaches (12 steps at most), so its gates and membership checks
    run and no request waits."""
    ps = ParameterServer(ServerSettings(timeout=5, algorithm=algorithm, staleness_bound=bound),
                         secret=SECRET, rule=make_rule(algorithm, np.zeros(4, dtype), lr=0.1))
    refusals = 0
    with ps:
        peers = [PSClient(ps.address, secret=SECRET, worker=w, numel=4, dtype=dtype,
                          timeout=5) for w in (DRIVER, 0, 1, 2)]
        driver, workers, honest = peers[0], peers[1:3], peers[3]
        pushers = {0: workers[0], 1: workers[1], "driver": driver}
        try:
            for step in steps:
                try:
                    if step[0] == "init":
                        driver.init(finite_array(step[1], dtype), workers=step[2])
                    elif step[0] == "pull":
                        workers[step[1]].pull()
                    elif step[0] == "push":
                        _, w, pull_first, values, lr, loss_sum, samples = step
                        if pull_first:
                            pushers[w].pull()
                        pushers[w].push(finite_array(values, dtype), lr=lr,
                                        loss_sum=loss_sum, samples=samples)
                    elif step[0] == "finished":
                        workers[step[1]].finished(wait_s=0.0)
                    else:
                        driver.evaluate()
                except PeerRefused as exc:
                    assert exc.reason in REASONS and str(exc)
                    refusals += 1
                honest.pull()
                assert np.isfinite(honest.params).all(), (step, honest.params)
            stats = driver.stats()
            json.dumps(stats, allow_nan=False)  # every total a finite number
            assert sum(stats["refused"].values()) == refusals
        finally:
            for p in peers:
                p.close()
