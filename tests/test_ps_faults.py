"""The parameter server against authenticated peers sending finite but hostile values, and
against requests at odd moments (issue 33): a result that would not be finite is refused
with "non_finite" and changes nothing; a re-INIT replaces the set of clocks; a PULL or UPDATE
after FINISHED, and a connection taken over mid-request, get a refusal with a reason, never
an unhandled exception. Frames the client library would not send go over the raw wire."""

from __future__ import annotations

import json
import logging
import math
import re
import time

import numpy as np
import pytest
from polling import wait_for

from sparkdl_avg import ProtocolError
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.fields import MAX_NUMBER
from sparkdl_avg.net.frames import Kind
from sparkdl_avg.ps.client import PSClient
from sparkdl_avg.ps.rules import make_rule
from sparkdl_avg.ps.server import DRIVER, ParameterServer
from sparkdl_avg.ps.settings import ServerSettings

SECRET = b"q" * 32


def server(algorithm: str = "downpour", params=None, tls=None, **settings) -> ParameterServer:
    params = np.zeros(4, np.float32) if params is None else params
    return ParameterServer(ServerSettings(timeout=10, algorithm=algorithm, **settings),
                           secret=SECRET, rule=make_rule(algorithm, params, lr=0.1), tls=tls)


def client(ps: ParameterServer, worker: int, ca: str | None = None) -> PSClient:
    return PSClient(ps.address, secret=SECRET, worker=worker, numel=4, dtype=np.float32,
                    timeout=10, tls_ca_pem=ca)


def raw_update(c: PSClient, update: np.ndarray, **fields) -> None:
    """An UPDATE as bytes on the wire: any finite lr, loss_sum or samples the fields allow."""
    c._conn.send(Kind.UPDATE, {"dtype": str(update.dtype), "numel": update.size, **fields},
                 update)


def refused(c: PSClient) -> str:
    """The reason of the refusal the server answered with."""
    with pytest.raises(ProtocolError) as info:
        msg.expect(c._conn, msg.Ack)
    return info.value.reason


@pytest.fixture
def handler_errors(caplog):
    caplog.set_level(logging.ERROR, logger="sparkdl_avg")
    return lambda: [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# --- 1. finite inputs, non-finite results ---------------------------------------------------

def test_downpour_refuses_updates_that_overflow_the_parameters():
    with server() as ps, client(ps, 0) as c:
        c.pull()
        big = np.full(4, 3e38, np.float32)
        assert c.push(big).applied == 1  # -3e38: still finite
        raw_update(c, big)
        assert refused(c) == "non_finite"  # -6e38 is -inf in float32
        c.pull()
        assert np.all(c.params == np.float32(-3e38))
        assert c.push(-big).applied == 2  # the same connection goes on
        c.pull()
        assert c.params.tolist() == [0.0] * 4
        assert ps.stats()["refused"] == {"non_finite": 1}


@pytest.mark.parametrize("algorithm", ["dcasgd", "dcasgd-adaptive"])
def test_dcasgd_refuses_a_tiny_lr_and_keeps_its_state(algorithm):
    """g = update / lr overflows: refused, and the parameters, the worker's backup and the
    mean square are as if the update had never come (the next one matches a rule that
    never saw it)."""
    w0 = np.array([0.5, -1.0, 2.0, 0.25], np.float32)
    good = np.array([0.01, -0.02, 0.03, 0.0], np.float32)
    expected = make_rule(algorithm, w0.copy(), lr=0.1)
    expected.pull(0)
    expected.apply(0, good.copy(), lr=0.1)
    with server(algorithm, w0.copy()) as ps, client(ps, 0) as c:
        c.pull()
        raw_update(c, np.full(4, 1e-3, np.float32), lr=1e-300)
        assert refused(c) == "non_finite"
        # read before the pull below, which would copy the parameters into the backup
        assert np.array_equal(ps.rule.backups[0], w0) and np.array_equal(ps.rule.params, w0)
        if algorithm == "dcasgd-adaptive":
            assert ps.rule.meansquare is None or not ps.rule.meansquare.any()
        c.pull()
        assert np.array_equal(c.params, w0)
        c.push(good, lr=0.1)
        c.pull()
        np.testing.assert_array_equal(c.params, expected.params)
        if algorithm == "dcasgd-adaptive":
            np.testing.assert_array_equal(ps.rule.meansquare, expected.meansquare)


def test_an_update_from_the_driver_is_refused_and_changes_nothing(handler_errors):
    """The driver's id holds no clock: its UPDATE passed the gates, was applied, and then
    the handler died on a KeyError (parameters changed, no answer, connection dropped)."""
    with server() as ps, client(ps, DRIVER) as driver:
        driver.pull()
        raw_update(driver, np.ones(4, np.float32))
        assert refused(driver) == "unexpected"
        assert driver.pull() == 0 and driver.params.tolist() == [0.0] * 4  # still served
        assert ps.stats()["applied"] == 0 and ps.stats()["refused"] == {"unexpected": 1}
        assert handler_errors() == []


def test_an_init_that_is_not_finite_is_refused():
    ps = ParameterServer(ServerSettings(timeout=10), secret=SECRET)
    with ps, client(ps, DRIVER) as driver:
        for bad in (np.nan, np.inf):
            with pytest.raises(ProtocolError) as info:
                driver.init(np.full(4, bad, np.float32), workers=1)
            assert info.value.reason == "non_finite"
        assert ps.rule is None  # still no parameters
        driver.init(np.ones(4, np.float32), workers=1)
        with client(ps, 0) as c:
            c.pull()
            assert c.params.tolist() == [1.0] * 4


def test_totals_that_would_leave_their_range_are_refused():
    """loss_sum past the largest float, samples past 2^53: refused, the stats stay finite
    numbers (JSON without Infinity); the mean lr cannot overflow either."""
    with server() as ps, client(ps, 0) as a, client(ps, 1) as b:
        a.pull()
        b.pull()
        zero = np.zeros(4, np.float32)
        raw_update(a, zero, samples=1, loss_sum=1.7e308, lr=1e308)
        msg.expect(a._conn, msg.Ack)
        raw_update(b, zero, samples=1, loss_sum=1.7e308, lr=1e308)
        assert refused(b) == "non_finite"
        raw_update(b, zero, samples=MAX_NUMBER, loss_sum=0.0, lr=1e308)
        assert refused(b) == "oversized"  # 1 + 2^53
        raw_update(b, zero, samples=MAX_NUMBER - 1, loss_sum=0.0, lr=1e308)
        msg.expect(b._conn, msg.Ack)
        stats = a.stats()
        json.dumps(stats, allow_nan=False)
        assert stats["samples"] == MAX_NUMBER and stats["loss_sum"] == 1.7e308
        assert stats["lr"] == pytest.approx(1e308) and math.isfinite(stats["lr"])
        assert stats["applied"] == 2
        assert stats["refused"] == {"non_finite": 1, "oversized": 1}


def test_evaluation_sums_that_overflow_make_no_infinite_result():
    """Two workers' finite sums of 1.7e308 add up past the largest float: the result says
    "not finite" (loss None) instead of carrying Infinity to the driver."""
    from sparkdl_avg.ps.evaluations import Evaluations

    for weight, expected_weight in ((1.0, 2.0), (1.7e308, 0.0)):
        evaluations = Evaluations()
        evaluations.reset(2)
        request = evaluations.ask(np.zeros(2), 0).request
        for w in (0, 1):
            done = evaluations.answer(w, request, {
                "loss_sum": 1.7e308 if weight == 1.0 else 1.0, "loss_weight": weight,
                "correct": None, "scored": None, "count": 1, "eval_s": 0.1})
        assert done["loss_sum"] is None and done["loss_weight"] == expected_weight
        json.dumps(done, allow_nan=False)


# --- 2. a re-INIT replaces the set of clocks ------------------------------------------------

def test_a_reinit_with_fewer_workers_replaces_the_clocks():
    """The driver re-inits for 2 workers after 3: no phantom clock of worker 2 holds the
    real workers at bound 0 (they used to wait on it until the server's timeout), and a
    connected worker 2 is no member any more."""
    # The server's timeout is far above the bound asserted below, so a loaded machine
    # cannot make the phantom wait and a slow pass look alike.
    ps = ParameterServer(ServerSettings(timeout=20, staleness_bound=0), secret=SECRET)
    with ps, client(ps, DRIVER) as driver:
        driver.init(np.zeros(4, np.float32), workers=3)
        leftover = client(ps, 2)
        leftover.stats()  # a round trip: it is connected (as a member) before the re-INIT
        driver.init(np.zeros(4, np.float32), workers=2)
        with client(ps, 0) as a, client(ps, 1) as b:
            started = time.monotonic()
            for _ in range(3):
                a.pull()
                b.pull()
                a.push(np.ones(4, np.float32))
                b.push(np.ones(4, np.float32))
            assert time.monotonic() - started < 10  # no wait on worker 2
            assert ps.stats()["clocks"] == {"0": 3, "1": 3}
        with pytest.raises(ProtocolError, match="not announced") as info:
            leftover.pull()
        assert info.value.reason == "unexpected"
        leftover.close()


# --- 3. requests at odd moments -------------------------------------------------------------

@pytest.mark.parametrize("workers", [1, 2])
def test_a_pull_or_push_after_finished_is_refused_with_a_reason(workers, handler_errors):
    """Under a staleness bound, a PULL after FINISHED raised KeyError (two workers) or
    ValueError on an empty min() (one), and the handler died."""
    ps = ParameterServer(ServerSettings(timeout=5, staleness_bound=1), secret=SECRET)
    with ps, client(ps, DRIVER) as driver:
        driver.init(np.zeros(4, np.float32), workers=0)
        others = [client(ps, w) for w in range(1, workers)]
        for o in others:
            o.pull()  # read: worker 0's push need not wait for it
        with client(ps, 0) as c:
            c.pull()
            c.push(np.ones(4, np.float32))
            c.finished(wait_s=0.01)
            c._conn.send(Kind.PULL, {})
            with pytest.raises(ProtocolError, match="has finished") as info:
                msg.expect(c._conn, msg.Params)
            assert info.value.reason == "unexpected"
            raw_update(c, np.ones(4, np.float32))
            assert refused(c) == "unexpected"
            assert c.stats()["applied"] == 1  # still served
        for o in others:
            o.close()
        assert handler_errors() == []
        assert ps.stats()["refused"] == {"unexpected": 2}


@pytest.mark.parametrize("tls", [False, True])
def test_a_takeover_mid_request_refuses_the_older_request_and_applies_nothing(
        tls, handler_errors, tmp_path):
    """Worker 0's second push waits at bound 0 for worker 1's read when a newer connection
    takes over worker 0. The older connection used to be closed under its handler, which
    then applied the update and failed to send its ACK (EBADF): an update applied and
    unacknowledged. Now the older one gets a refusal and nothing is applied (under TLS too:
    its reads end without dropping its TLS state)."""
    context, ca = None, None
    if tls:
        from test_ps_tls import self_signed

        from sparkdl_avg.net.tls import server_context

        cert, key, ca = self_signed(tmp_path)
        context = server_context(str(cert), str(key))
    with server(staleness_bound=0, tls=context) as ps, client(ps, 0, ca) as old, \
            client(ps, 1, ca) as other:
        old.pull()
        other.pull()
        old.push(np.ones(4, np.float32))
        raw_update(old, np.ones(4, np.float32))  # waits for worker 1's next read
        time.sleep(0.3)
        new = client(ps, 0, ca)  # the restarted task
        new.stats()  # a round trip: its handler owns worker 0 now (WELCOME comes before)
        other.push(np.ones(4, np.float32))
        other.pull()  # would open the older push's gate
        reply, _ = msg.receive(old._conn)
        assert isinstance(reply, msg.Refusal) and reply.reason == "unexpected"
        assert "took over" in reply.message
        assert ps.stats()["applied"] == 2  # the older second push never applied
        wait_for(lambda: len(ps._conns) == 2)  # its handler ended and closed it
        assert new.pull() == 2 and new.params.tolist() == [-2.0] * 4
        new.close()
        assert handler_errors() == []


def test_a_reply_in_flight_at_a_takeover_arrives_whole(handler_errors):
    """The older connection's handler is sending it parameters larger than the socket
    buffers (its peer not reading yet) when a newer connection takes over worker 0: the
    reply still arrives whole, since a take-over only ends the older one's reads. Closing
    its socket under the handler (as before) cut such a send short with EBADF, as it did an
    applied update's ACK."""
    n = 1 << 23  # 32 MiB of float32: more than the loopback buffers hold
    w = np.arange(n, dtype=np.float32)

    def connect() -> PSClient:
        return PSClient(ps.address, secret=SECRET, worker=0, numel=n, dtype=np.float32,
                        timeout=10)

    with server(params=w.copy()) as ps, connect() as old:
        old._conn.send(Kind.PULL, {})  # its answer is not read yet
        wait_for(lambda: ps.clocks.read.get(0) == 0)  # the handler has copied them: it sends
        time.sleep(0.2)
        with connect() as new:
            new.stats()  # a round trip: it owns worker 0 now
            reply, _ = msg.expect(old._conn, msg.Params,
                                  into=msg.into_checked(old.params, "the parameter server"))
            assert reply.version == 0 and np.array_equal(old.params, w)
            with pytest.raises(ProtocolError) as info:  # then it is refused: taken over
                old.pull()
            assert info.value.reason in ("unexpected", "closed")
            assert new.pull() == 0 and np.array_equal(new.params, w)
    assert handler_errors() == []


def test_a_refused_result_fails_the_task_as_a_refused_nan_update_does(monkeypatch):
    """A fit fails at once, naming the partition, on a refused NaN update
    (tests/test_faults_async.py). A refused *result* (finite updates that overflow) reaches
    the task the same way: the worker's call raises the same PeerRefused (no lost server, so
    no reconnect), the task ends with a final error, and the driver's error reads the same."""
    from sparkdl_avg._errors import FinalTaskError, PeerRefused, TrainingError, from_task
    from sparkdl_avg.task import entry, memory, probe
    from sparkdl_avg.task.async_loop import ServerLink

    refusals = []
    with server() as ps, client(ps, 0) as c:
        c.pull()
        c.push(np.full(4, 3e38, np.float32))
        for update in (np.array([np.nan, 0, 0, 0], np.float32), np.full(4, 3e38, np.float32)):
            with pytest.raises(PeerRefused) as info:
                ServerLink._call(None, c.push, update)  # a worker's push (self is unused)
            refusals.append(info.value)
    monkeypatch.setattr(probe, "warmed_up", lambda: None)
    monkeypatch.setattr(memory, "release_task_memory", lambda: None)
    texts = []
    for refusal in refusals:
        assert refusal.reason == "non_finite"

        def run(spec, batches, refusal=refusal):
            raise refusal

        monkeypatch.setattr(entry, "_run", run)
        with pytest.raises(FinalTaskError) as info:  # the task's own wrapper: final
            next(entry.run_task(None, iter(())))
        error = from_task("partition 0", str(info.value))  # as the driver reads it
        assert isinstance(error, TrainingError)
        assert re.fullmatch(r"partition 0 failed: PeerRefused: .*NaN or Inf.*", str(error))
        texts.append(str(error))
    assert texts[0] == texts[1]  # one message for both: the update, or its result


def test_a_finished_from_a_taken_over_connection_changes_nothing():
    """A FINISHED read on the older connection just before a take-over reaches its handler
    after it: it used to mark the worker finished for the evaluations (whose final request
    waits for every worker) though the newer connection goes on pushing. Called here as
    that handler would, on a connection that no longer owns worker 0."""
    import socket

    from sparkdl_avg.net.frames import Connection

    ps = ParameterServer(ServerSettings(timeout=10), secret=SECRET)
    ours, theirs = socket.socketpair()
    with ps, client(ps, DRIVER) as driver, ours, theirs:
        driver.init(np.zeros(4, np.float32), workers=2)
        with client(ps, 0) as newer:
            newer.stats()  # the owner of worker 0
            stale = Connection(theirs, timeout=5, max_payload=0)
            ps._finished(stale, 0, msg.Finished(wait_s=0.0))
            with pytest.raises(ProtocolError, match="took over") as info:
                msg.expect(Connection(ours, timeout=5, max_payload=0), msg.Ack)
            assert info.value.reason == "unexpected"
            assert ps.evaluations.finished == set() and 0 in ps.clocks.pushed
            assert newer.finished(wait_s=0.0) is not None  # its own FINISHED counts
            assert ps.evaluations.finished == {0}


def test_the_driver_connects_again_to_a_users_server_restarted_on_its_port():
    """A `ps serve --shards` supervisor restarts a shard from its checkpoint on its port; the
    workers reconnect by design, and the driver must too (it failed the fit: 'lost the
    parameter server'). One that stays away fails the fit after reconnect_timeout."""
    from sparkdl_avg import TrainingError
    from sparkdl_avg.driver.server_connection import ServerConnection

    def serve(port: int = 0) -> ParameterServer:
        ps = ParameterServer(ServerSettings(timeout=10), secret=SECRET, port=port,
                             rule=make_rule("downpour", np.zeros(4, np.float32)))
        ps.start()
        return ps

    first = serve()
    port = first.address[1]

    def connect() -> PSClient:
        return PSClient(("127.0.0.1", port), secret=SECRET, worker=DRIVER, numel=4,
                        dtype=np.float32, timeout=10)

    server = ServerConnection([], connect, restarts=None, run=None, reconnect_s=1.0)
    assert server.call(lambda ps: ps.stats()["applied"], 0) == 0
    calls = []

    def slow(ps):  # a live server's timeout is not its absence: no reconnect, no call again
        calls.append(ps)
        raise TimeoutError("timed out")

    with pytest.raises(TrainingError, match="lost the parameter server: timed out"):
        server.call(slow, 0)
    assert len(calls) == 1
    first.close()
    second = serve(port)
    try:
        assert server.call(lambda ps: ps.stats()["applied"], 0) == 0
    finally:
        second.close()
    started = time.monotonic()  # the server stays away
    with pytest.raises(TrainingError, match="lost the parameter server"):
        server.call(lambda ps: ps.stats(), 0)
    assert time.monotonic() - started < 8
    server.close()
