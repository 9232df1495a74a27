"""The servers against strangers and against authenticated peers sending odd things: every
refusal answered with its reason and counted, ids and dtypes checked, connections capped,
one live connection per worker id."""

from __future__ import annotations

import json
import socket
import threading
import time
import tracemalloc

import numpy as np
import pytest
from polling import wait_for

from sparkdl_avg import ProtocolError
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.frames import HEADER, MAGIC, VERSION, Connection, Kind
from sparkdl_avg.ps.client import PSClient
from sparkdl_avg.ps.rules import make_rule
from sparkdl_avg.ps.server import DRIVER, ParameterServer
from sparkdl_avg.ps.settings import ServerSettings

SECRET = b"h" * 32


def server(**settings) -> ParameterServer:
    rule = make_rule("downpour", np.zeros(4, np.float32))
    return ParameterServer(ServerSettings(timeout=10, **settings), secret=SECRET, rule=rule)


def client(ps: ParameterServer, worker: int) -> PSClient:
    return PSClient(ps.address, secret=SECRET, worker=worker, numel=4, dtype=np.float32,
                    timeout=10)


def test_a_second_connection_with_the_same_worker_id_replaces_the_first():
    with server() as ps:
        old = client(ps, 0)
        old.pull()
        new = client(ps, 0)  # the same id: the newer connection takes over
        new.pull()   # answered: the take-over, which follows the handshake, has run
        new.close()  # the newer leaves first, which used to break the older one's PULL
        with pytest.raises((ProtocolError, OSError)):
            old.pull()       # the older connection was closed when it was replaced
        old.close()
        with client(ps, 0) as again:  # the id is free; the server is fine
            again.pull()
            again.push(np.ones(4, np.float32))
        assert ps.applied == 1


def test_a_payload_in_another_dtype_is_refused_even_with_the_same_byte_count():
    with server() as ps, client(ps, 0) as c:
        c.pull()
        for wrong in (np.ones(2, np.float64), np.ones(4, np.int32)):  # 16 bytes, like 4 x f32
            with pytest.raises(ProtocolError) as info:  # sent raw: Update refuses int32 itself
                c._conn.send(Kind.UPDATE, {"dtype": str(wrong.dtype), "numel": wrong.size},
                             wrong)
                msg.expect(c._conn, msg.Ack)
            assert info.value.reason in ("shape", "malformed")
            c.close()
            c = client(ps, 0)
            c.pull()
        assert ps.applied == 0
        assert ps.stats()["refused"] == {"shape": 1, "malformed": 1}
        c.close()


def test_worker_ids_outside_the_announced_set_are_refused():
    ps = ParameterServer(ServerSettings(timeout=10), secret=SECRET)
    with ps, PSClient(ps.address, secret=SECRET, worker=DRIVER, numel=4, dtype=np.float32,
                      timeout=10) as driver:
        driver.init(np.zeros(4, np.float32), workers=2)
        with pytest.raises(ProtocolError, match="worker id 5 is not one of the 2 announced"):
            client(ps, 5).pull()
        with client(ps, 1) as ok:
            ok.pull()
        assert ps.stats()["refused"] == {"unexpected": 1}


AUTH = json.dumps({"nonce": "ab", "mac": "cd", "role": "worker:0",
                   "hello": {"worker": 0}}).encode()


def _raw_handshake_reply(ps: ParameterServer, frame: bytes) -> msg.Message:
    """Send `frame` where the AUTH should be; the server's answer."""
    with socket.create_connection(ps.address, timeout=5) as sock:
        conn = Connection(sock, timeout=5, max_payload=0)
        msg.expect(conn, msg.Challenge)
        sock.sendall(frame)
        return msg.receive(conn)[0]


@pytest.mark.parametrize(("frame", "reason"), [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "magic"),
    (HEADER.pack(MAGIC, VERSION + 1, Kind.AUTH, 0, 0, 0), "version"),
    (HEADER.pack(MAGIC, VERSION, 99, 0, 0, 0), "kind"),
    (HEADER.pack(MAGIC, VERSION, Kind.AUTH, 0, 1 << 20, 0), "oversized"),
    (HEADER.pack(MAGIC, VERSION, Kind.AUTH, 0, 2, 0) + b"{}", "malformed"),
    (HEADER.pack(MAGIC, VERSION, Kind.AUTH, 0, len(AUTH), 16) + AUTH, "oversized"),
])
def test_refusals_before_authentication_get_an_error_with_their_reason(frame, reason):
    with server() as ps:
        reply = _raw_handshake_reply(ps, frame)
        assert isinstance(reply, msg.Refusal) and reply.reason == reason
        wait_for(lambda: ps.stats()["refused"] == {reason: 1})


def test_pending_handshakes_are_capped_by_dropping_the_oldest_stranger():
    ps = ParameterServer(ServerSettings(timeout=10), secret=SECRET, max_pending=4,
                         rule=make_rule("downpour", np.zeros(4, np.float32)))
    with ps:
        idle = [socket.create_connection(ps.address, timeout=5) for _ in range(10)]
        wait_for(lambda: ps.stats()["refused"].get("capacity", 0) >= 6)
        started = time.monotonic()
        with client(ps, 0) as c:  # a worker gets in at once all the same
            c.pull()
        assert time.monotonic() - started < 2
        for s in idle:
            s.close()


def test_authenticated_connections_are_capped():
    with server(max_connections=2) as ps, client(ps, 0) as a, client(ps, 1) as b:
        a.pull()
        b.pull()
        with pytest.raises(ProtocolError, match="serves 2 connections already"):
            client(ps, 2).pull()
        assert ps.stats()["refused"] == {"capacity": 1}


def test_a_frame_that_claims_much_and_sends_little_allocates_little():
    a, b = socket.socketpair()
    conn = Connection(b, timeout=5, max_payload=1 << 30)  # a driver's limit
    a.sendall(HEADER.pack(MAGIC, VERSION, Kind.INIT, 0, 0, 60 << 20) + b"x" * 1000)
    a.close()
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="closed by the peer"):
            conn.recv()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        conn.close()
    assert peak < 4 << 20  # not the 60 MiB the header claimed


def test_the_accept_loop_survives_running_out_of_file_descriptors(caplog):
    """A connection that arrives while this process has no descriptor left cannot be
    accepted: the server logs it, backs off, and accepts it once descriptors are back."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with server() as ps:
        waiting = socket.socket()  # made now: connect() needs no new descriptor later
        waiting.settimeout(10)
        held = []
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
            try:
                while True:
                    held.append(socket.socket())
            except OSError:
                pass
            waiting.connect(ps.address)  # queued by the kernel; accept() must fail now
            wait_for(lambda: "cannot accept" in caplog.text)
        finally:
            for s in held:
                s.close()
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        conn = Connection(waiting, timeout=10, max_payload=0)
        msg.expect(conn, msg.Challenge)  # accepted after all, and answered
        conn.close()
        assert ps.failure is None
        with client(ps, 0) as c:
            c.pull()


def test_closing_a_server_returns_at_once():
    """close() wakes the accept loop instead of waiting out its poll (0.25 s): every fit
    closes three servers on its critical path (the probe's, the load monitor, the
    coordinator), and each used to cost a poll's wait."""
    from sparkdl_avg.net.server import Server

    took = []
    for _ in range(5):
        s = Server(secret=b"s" * 32, name="closing")
        s.start()
        time.sleep(0.05)  # the accept loop is blocked in its poll
        t0 = time.perf_counter()
        s.close()
        took.append(time.perf_counter() - t0)
        assert s.failure is None and not s._accept_thread.is_alive()
    assert sorted(took)[2] < 0.05, took


def test_finished_connections_are_forgotten():
    with server() as ps:
        for _ in range(200):
            socket.create_connection(ps.address, timeout=5).close()
        with client(ps, 0) as c:
            c.pull()
        wait_for(lambda: len(ps._conns) == 0 and len(ps._pending) == 0)


def test_a_queued_handshake_gets_its_own_thread_not_a_busy_ones():
    """An idle handler already promised to one job must not be counted for the next."""
    from sparkdl_avg.net.server import _HandlerPool

    pool = _HandlerPool(4, "test")
    warm = threading.Event()
    pool.submit(warm.set)
    assert warm.wait(5)
    wait_for(lambda: pool._idle == 1)
    release, ran = threading.Event(), threading.Event()
    with pool._cond:  # both arrive before the idle thread wakes
        pool.submit(release.wait, 10)
        pool.submit(ran.set)
    assert ran.wait(5)  # not stuck behind the blocked one
    release.set()
    pool.close(5)


def test_tls_material_shipped_to_executors_holds_no_private_key(tmp_path):
    from test_ps_tls import self_signed

    from sparkdl_avg.net.tls import read_certificates

    cert, key, _ = self_signed(tmp_path)
    combined = tmp_path / "combined.pem"
    combined.write_text(cert.read_text() + key.read_text())
    shipped = read_certificates(str(combined), "tls_cert")
    assert "CERTIFICATE" in shipped and "PRIVATE KEY" not in shipped
