"""The wire refuses what it must (wrong secret, malformed or oversized frames) and never hangs."""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from sparkdl_avg import ProtocolError
from sparkdl_avg.averaging.coordinator import Coordinator
from sparkdl_avg.net import auth
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.frames import VERSION, Connection, Kind, connect


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    ca = Connection(a, timeout=5, max_payload=1024)
    cb = Connection(b, timeout=5, max_payload=1024)
    yield ca, cb
    ca.close()
    cb.close()


def test_frames_round_trip_with_raw_tensor_payload(pair):
    a, b = pair
    data = np.arange(100, dtype=np.float32)
    a.send(Kind.PUSH, {"round": 3}, data)
    into = np.zeros(100, np.float32)
    frame = b.recv(into)
    assert frame.kind is Kind.PUSH and frame.meta == {"round": 3}
    assert np.array_equal(into, data)


def test_payload_of_the_wrong_size_is_refused(pair):
    a, b = pair
    a.send(Kind.PUSH, {}, np.zeros(10, np.float32))
    with pytest.raises(ProtocolError, match="40 bytes where 80 were expected"):
        b.recv(np.zeros(10, np.float64))


def test_oversized_payload_is_refused_before_reading_it(pair):
    a, b = pair
    a.sock.sendall(struct.pack("!4sBBHIQ", b"SDLA", VERSION, Kind.PUSH, 0, 0, 1 << 40))
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        b.recv()


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (struct.pack("!4sBBHIQ", b"HTTP", 1, 4, 0, 0, 0), "bad magic"),
        (struct.pack("!4sBBHIQ", b"SDLA", VERSION + 1, 4, 0, 0, 0), f"version {VERSION + 1}"),
        (struct.pack("!4sBBHIQ", b"SDLA", VERSION, 99, 0, 0, 0), "unknown frame kind"),
        (struct.pack("!4sBBHIQ", b"SDLA", VERSION, 4, 0, 1 << 30, 0), "metadata of"),
        (struct.pack("!4sBBHIQ", b"SDLA", VERSION, 4, 0, 3, 0) + b"{x}", "not JSON"),
        (struct.pack("!4sBBHIQ", b"SDLA", VERSION, 4, 0, 2, 0) + b"[]", "JSON object"),
    ],
)
def test_malformed_frames_are_refused(pair, header, message):
    a, b = pair
    a.sock.sendall(header)
    with pytest.raises(ProtocolError, match=message):
        b.recv()


def test_truncated_frame_is_a_protocol_error(pair):
    a, b = pair
    a.sock.sendall(struct.pack("!4sBBHIQ", b"SDLA", VERSION, Kind.PUSH, 0, 0, 8) + b"1234")
    a.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError, match="closed by the peer"):
        b.recv(np.zeros(2, np.float32))


def test_a_silent_peer_times_out():
    a, b = socket.socketpair()
    conn = Connection(b, timeout=0.2, max_payload=0)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        conn.recv()
    assert time.monotonic() - started < 2
    a.close()
    conn.close()


def _handshake(server_secret: bytes, client_secret: bytes):
    a, b = socket.socketpair()
    client = Connection(b, timeout=5, max_payload=0)
    result: dict = {}

    def serve():
        try:
            conn, result["hello"] = auth.accept(a, server_secret)
            conn.close()
        except ProtocolError as exc:
            result["server_error"] = exc

    t = threading.Thread(target=serve)
    t.start()
    try:
        auth.authenticate_to_server(client, client_secret, msg.ServerHello(worker=1))
    except ProtocolError as exc:
        result["client_error"] = exc
    t.join(5)
    client.close()
    return result


def test_mutual_authentication_with_the_shared_secret():
    secret = auth.new_secret()
    assert _handshake(secret, secret) == {"hello": {"worker": 1, "attempt": 0}}


def test_wrong_secret_is_refused_on_both_sides():
    result = _handshake(auth.new_secret(), auth.new_secret())
    assert "wrong secret" in str(result["server_error"])
    assert "authentication failed" in str(result["client_error"])


HELLO = {"rank": 0, "host": "h"}


def test_coordinator_refuses_intruders_and_keeps_serving_its_workers():
    secret = auth.new_secret()
    with Coordinator(host="127.0.0.1", advertise="127.0.0.1", num_workers=1, secret=secret,
                     timeout=5, dtype=np.float32, model_numel=4,
                     check_job=lambda wait: None) as coord:
        received = {}

        def intruders_then_worker():
            # garbage bytes; deeply nested JSON; a non-ASCII MAC; the wrong secret; then the
            # real worker, which must still be served.
            with socket.create_connection(coord.address, timeout=5) as s:
                s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            nested = b"[" * 4000
            with socket.create_connection(coord.address, timeout=5) as s:
                s.recv(4096)  # the challenge
                s.sendall(struct.pack("!4sBBHIQ", b"SDLA", VERSION, Kind.AUTH, 0, len(nested), 0)
                          + nested)
            odd = connect(coord.address, timeout=5, max_payload=64)
            msg.expect(odd, msg.Challenge)
            odd.send(Kind.AUTH, {"nonce": "00", "mac": "\u00e9t\u00e9", "hello": HELLO})
            odd.close()
            bad = connect(coord.address, timeout=5, max_payload=64)
            with pytest.raises(ProtocolError):
                auth.authenticate_to_server(bad, auth.new_secret(), msg.WorkerHello(**HELLO))
            bad.close()
            stranger = connect(coord.address, timeout=5, max_payload=64)  # no rank of ours
            with pytest.raises(ProtocolError, match="rank 7 is unknown"):
                auth.authenticate_to_server(stranger, secret,
                                            msg.WorkerHello(**{**HELLO, "rank": 7}))
                msg.expect(stranger, msg.Average)
            stranger.close()
            worker = connect(coord.address, timeout=5, max_payload=64)
            auth.authenticate_to_server(worker, secret, msg.WorkerHello(**HELLO))
            into = np.zeros(4, np.float32)
            received["frame"] = msg.expect(worker, msg.Average, into)
            received["params"] = into
            worker.close()

        t = threading.Thread(target=intruders_then_worker)
        t.start()
        coord.accept_workers(np.arange(4, dtype=np.float32), deadline_s=20)
        t.join(10)
    assert received["params"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_idle_strangers_do_not_hold_up_the_workers():
    """Handshakes run concurrently: connections that never authenticate (each may take the
    10 s handshake deadline) delay nobody."""
    secret = auth.new_secret()
    with Coordinator(host="127.0.0.1", advertise="127.0.0.1", num_workers=1, secret=secret,
                     timeout=5, dtype=np.float32, model_numel=2,
                     check_job=lambda wait: None) as coord:
        idle = [socket.create_connection(coord.address, timeout=5) for _ in range(3)]

        def worker():
            conn = connect(coord.address, timeout=5, max_payload=64)
            auth.authenticate_to_server(conn, secret, msg.WorkerHello(**HELLO))
            msg.expect(conn, msg.Average, np.zeros(2, np.float32))
            conn.close()

        t = threading.Thread(target=worker)
        started = time.monotonic()
        t.start()
        coord.accept_workers(np.zeros(2, np.float32), deadline_s=20)
        assert time.monotonic() - started < 3
        t.join(5)
        for s in idle:
            s.close()
