"""A sync worker's connect to the driver (`net.dial`, `DriverChannel.open`): within its
deadline, retried only where a retry can help, never leaving the driver holding a dead
connection for a rank, and its losing parallel connects closed."""

from __future__ import annotations

import contextlib
import gc
import socket
import ssl
import threading
import time
import warnings

import numpy as np
import pytest
from loopback import coordinator

from sparkdl_avg import ProtocolError
from sparkdl_avg.averaging.driver_channel import DriverChannel
from sparkdl_avg.net import auth
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.auth import Credential, new_secret
from sparkdl_avg.net.dial import first_connected, retryable
from sparkdl_avg.net.frames import HEADER, MAGIC, VERSION, Connection, Kind, connect

HELLO = msg.WorkerHello(rank=0, host="h")


def _channel(address, key: Credential, connect_timeout: float = 20) -> DriverChannel:
    return DriverChannel(address, key, connect_timeout=connect_timeout, reply_timeout=10)


class _Listener:
    """A raw server: each connection accepted is handed to `handle` on its own thread."""

    def __init__(self, handle) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        self.accepted: list[socket.socket] = []
        self._handle = handle
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


def test_a_slow_driver_handshake_is_waited_for_and_the_fit_starts(monkeypatch):
    """The driver answers the first AUTH only after 2.5 s (a loaded driver). The worker used
    to give the handshake 2 s, retry, and be refused while the driver kept the dead first
    connection for its rank: the start then went to that socket (Broken pipe)."""
    real_send, delayed = msg.send, []

    def slow_welcome(conn, message, *args, **kwargs):
        if isinstance(message, msg.Welcome):
            delayed.append(time.monotonic())
            time.sleep(2.5 if len(delayed) == 1 else 0)
        return real_send(conn, message, *args, **kwargs)

    monkeypatch.setattr(auth.msg, "send", slow_welcome)
    secret = new_secret()
    with coordinator(secret) as coord:
        channel = _channel(coord.address, Credential.of(secret, 0))
        channel.open(HELLO)
        monkeypatch.setattr(auth.msg, "send", real_send)
        try:
            coord.accept_workers(np.arange(4, dtype=np.float32), 10)
            into = np.zeros(4, np.float32)
            channel.receive_start(into)
        finally:
            channel.close()
        assert coord.refusals() == {}
    assert len(delayed) == 1  # one handshake: the worker waited for it, never retried
    assert into.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_rank_connecting_again_replaces_its_stale_connection():
    """A retried connect (or Spark's next attempt of a task) authenticates as a rank the
    driver already holds: the newer connection gets the start, the older is closed. It used
    to be refused, leaving the driver with the dead one."""
    secret = new_secret()
    with coordinator(secret, workers=2) as coord:
        stale = _channel(coord.address, Credential.of(secret, 0))
        stale.open(HELLO)
        fresh = _channel(coord.address, Credential.of(secret, 0))
        fresh.open(HELLO)
        other = _channel(coord.address, Credential.of(secret, 1))
        other.open(msg.WorkerHello(rank=1, host="h"))
        try:
            coord.accept_workers(np.arange(4, dtype=np.float32), 10)
            into = np.zeros(4, np.float32)
            fresh.receive_start(into)
            with pytest.raises(OSError):  # closed by the driver: no start for it
                stale.receive_start(np.zeros(4, np.float32))
        finally:
            for channel in (stale, fresh, other):
                channel.close()
        assert coord.refusals() == {}
    assert into.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_the_connect_deadline_holds_through_a_slow_handshake():
    """A server that sends its challenge after 1.9 s and then nothing: each socket read
    within its limit, but the whole connect must end by connect_timeout (it took 3.9 s of
    3 when the handshake's limit was per read)."""
    def challenge_late(conn: socket.socket) -> None:
        time.sleep(1.9)
        msg.send(Connection(conn, timeout=30, max_payload=0), msg.Challenge(nonce="ab" * 32))
        time.sleep(30)

    server = _Listener(challenge_late)
    channel = _channel(server.address, Credential("worker:0", b"k" * 32), connect_timeout=3)
    started = time.monotonic()
    try:
        with pytest.raises(OSError):
            channel.open(HELLO)
    finally:
        server.close()
    assert time.monotonic() - started < 3.3


def _refusing(reason: str, version: int = VERSION):
    """A server that refuses every client with `reason` (in a frame of `version`)."""
    def refuse(conn: socket.socket) -> None:
        body = f'{{"message":"no","reason":"{reason}"}}'.encode()
        with contextlib.suppress(OSError):  # the test may have ended and closed it
            conn.sendall(HEADER.pack(MAGIC, version, Kind.ERROR, 0, len(body), 0) + body)
        time.sleep(5)
    return refuse


@pytest.mark.parametrize("reason, version", [("auth", VERSION), ("role", VERSION),
                                             ("unexpected", VERSION), ("auth", VERSION - 1)])
def test_refusals_a_retry_would_repeat_are_raised_at_once(reason, version):
    server = _Listener(_refusing(reason, version))
    channel = _channel(server.address, Credential("worker:0", b"k" * 32), connect_timeout=10)
    started = time.monotonic()
    try:
        with pytest.raises(ProtocolError) as info:
            channel.open(HELLO)
    finally:
        server.close()
    assert info.value.reason == (reason if version == VERSION else "version")
    assert len(server.accepted) == 1  # one connect, no retry
    assert time.monotonic() - started < 2


def test_a_busy_server_is_retried_until_the_deadline():
    """`capacity` may pass: the client connects again, with pauses, until connect_timeout."""
    server = _Listener(_refusing("capacity"))
    channel = _channel(server.address, Credential("worker:0", b"k" * 32), connect_timeout=1.5)
    started = time.monotonic()
    try:
        with pytest.raises(ProtocolError, match="refused"):
            channel.open(HELLO)
    finally:
        server.close()
    assert len(server.accepted) >= 3
    assert time.monotonic() - started < 1.8


@pytest.mark.parametrize("exc, again", [
    (ConnectionResetError(), True), (TimeoutError(), True),
    (ProtocolError("busy", "capacity"), True), (ssl.SSLEOFError(), True),
    (ProtocolError("no", "auth"), False), (ProtocolError("no", "version"), False),
    (ssl.SSLCertVerificationError(), False), (ssl.SSLError(), False),
    (socket.gaierror(), False),
])
def test_what_is_retried(exc, again):
    """A wrong CA or host name, or a name that does not resolve, fails at once as it did
    before connects were retried."""
    assert retryable(exc) is again


def test_losing_parallel_connects_are_closed_and_every_address_is_tried(monkeypatch):
    """Eight connects at once: one is kept, the server sees the seven others end. The name
    resolves to an address where nothing listens first: the connect still succeeds."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    with socket.create_server(("127.0.0.1", 0)) as closed:
        dead_port = closed.getsockname()[1]
    real = socket.getaddrinfo

    def both(host, port_, *args, **kwargs):  # nothing listens on the first
        dead = real(host, dead_port, *args, **kwargs)
        return dead + real(host, port_, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", both)
    with warnings.catch_warnings(record=True) as warned:  # a socket left to the GC warns
        warnings.simplefilter("always", ResourceWarning)
        kept = first_connected(("127.0.0.1", port), 8, 2.0)
        gc.collect()
    monkeypatch.setattr(socket, "getaddrinfo", real)
    assert [w for w in warned if issubclass(w.category, ResourceWarning)] == []
    try:
        server.settimeout(2)
        accepted = []
        deadline = time.monotonic() + 2
        while len(accepted) < 4 and time.monotonic() < deadline:  # 4 of 8 went to `port`
            accepted.append(server.accept()[0])
        kept.sendall(b"x")
        ended = 0
        for peer in accepted:
            peer.settimeout(2)
            data = peer.recv(1)
            ended += data == b""
        assert len(accepted) == 4
        assert ended == 3  # the kept one sent "x"; the others are closed
    finally:
        kept.close()
        server.close()


def test_a_peer_that_sent_auth_is_never_evicted_by_strangers(monkeypatch):
    """`Server` drops the oldest stranger when handshakes are full, never a client whose
    AUTH is being checked: here the worker's check is held while strangers flood in."""
    secret = new_secret()
    checking, release = threading.Event(), threading.Event()
    real_key = auth.role_key

    def held(secret_, role):
        if role == "worker:0":
            checking.set()
            release.wait(10)
        return real_key(secret_, role)

    monkeypatch.setattr(auth, "role_key", held)
    coord = coordinator(secret)
    coord._max_pending = 2  # noqa: SLF001 - two handshakes at once: strangers must go
    with coord:
        result = {}

        def worker() -> None:  # one handshake, no retry that would hide an eviction
            conn = connect(coord.address, timeout=10, max_payload=64)
            try:
                auth.authenticate_to_server(
                    conn, Credential("worker:0", real_key(secret, "worker:0")), HELLO)
                result["welcomed"] = True
            except Exception as exc:  # noqa: BLE001 - asserted below
                result["error"] = exc
            finally:
                conn.close()

        thread = threading.Thread(target=worker)
        thread.start()
        assert checking.wait(5)
        strangers = [socket.create_connection(coord.address) for _ in range(6)]
        deadline = time.monotonic() + 5
        while coord.refusals().get("capacity", 0) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        release.set()
        thread.join(10)
        refused = coord.refusals()
        for s in strangers:
            s.close()
        assert result == {"welcomed": True}
        assert refused == {"capacity": 5}  # every stranger but the newest
