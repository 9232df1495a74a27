"""The mutual HMAC-SHA256 challenge-response every connection starts with.

The server challenges with a nonce; the client answers with its own nonce, its hello and a
MAC over both nonces' worth of context under the shared secret; the server checks it and
proves itself back. So only holders of the secret can join, and clients only trust a server
that holds it. Strangers get `HANDSHAKE_S` in total and `HANDSHAKE_META_BYTES` to parse.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import socket
import ssl
import time
from typing import Any

from sparkdl_avg._errors import ProtocolError
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.frames import MAX_META_BYTES, Connection

HANDSHAKE_S = 10.0
"""A peer has this long, in total, to authenticate."""
HANDSHAKE_META_BYTES = 4096
"""Metadata limit before a peer has authenticated: strangers get little to parse."""
_NONCE_BYTES = 32


def new_secret() -> bytes:
    return os.urandom(32)


def _mac(secret: bytes, *parts: bytes) -> str:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).hexdigest()


def _hello_bytes(hello: dict[str, Any]) -> bytes:
    return json.dumps(hello, sort_keys=True).encode()


def authenticate_client(conn: Connection, secret: bytes) -> dict[str, Any]:
    """Server side: the peer must prove it knows `secret`; then we prove it back. Returns
    the peer's hello (authenticated, not yet validated: that is the server's own message)."""
    nonce = os.urandom(_NONCE_BYTES)
    msg.send(conn, msg.Challenge(nonce=nonce.hex()))
    auth, _ = msg.expect(conn, msg.Auth)
    expected = _mac(secret, b"client", nonce, _hello_bytes(auth.hello))
    if not hmac.compare_digest(auth.mac, expected):
        raise ProtocolError("authentication failed (wrong secret)", "auth")
    msg.send(conn, msg.Welcome(mac=_mac(secret, b"server", bytes.fromhex(auth.nonce))))
    return auth.hello


def authenticate_to_server(conn: Connection, secret: bytes, hello: msg.Message) -> None:
    """Client side of `authenticate_client`; `hello` travels authenticated."""
    challenge, _ = msg.expect(conn, msg.Challenge)
    mine = os.urandom(_NONCE_BYTES)
    meta = hello.to_meta()
    mac = _mac(secret, b"client", bytes.fromhex(challenge.nonce), _hello_bytes(meta))
    msg.send(conn, msg.Auth(nonce=mine.hex(), mac=mac, hello=meta))
    welcome, _ = msg.expect(conn, msg.Welcome)
    if not hmac.compare_digest(welcome.mac, _mac(secret, b"server", mine)):
        raise ProtocolError("the server failed authentication (wrong secret)", "auth")


def refusal_reason(exc: BaseException) -> str:
    """The refusal code of a failed handshake."""
    if isinstance(exc, ProtocolError):
        return exc.reason
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionError):  # reset, aborted, broken pipe
        return "closed"
    return "auth"  # a TLS failure, or a peer that is no client of ours


def accept(sock: socket.socket, secret: bytes, *, tls: ssl.SSLContext | None = None
           ) -> tuple[Connection, dict[str, Any]]:
    """Server side of a new connection: TLS (optional), then the handshake, all within
    HANDSHAKE_S and a small metadata limit, so a stranger can neither stall nor flood us.
    Returns the connection (limits reset to normal) and the peer's authenticated hello. If
    anything fails the peer gets an ERROR naming the reason, where it can still read one,
    and the socket is closed."""
    conn = None
    deadline = time.monotonic() + HANDSHAKE_S  # one deadline for TLS and HMAC together
    try:
        if tls is not None:
            sock.settimeout(HANDSHAKE_S)
            sock = tls.wrap_socket(sock, server_side=True)
        conn = Connection(sock, timeout=HANDSHAKE_S, max_payload=0,
                          max_meta=HANDSHAKE_META_BYTES)
        conn.deadline = deadline
        hello = authenticate_client(conn, secret)
    except BaseException as exc:
        reason = refusal_reason(exc)
        if conn is not None and reason != "closed":
            with contextlib.suppress(OSError):
                conn.sock.settimeout(1.0)  # a peer that does not read gets no more time
                msg.send(conn, msg.Refusal(message=str(exc)[:500], reason=reason))
        (conn or sock).close()
        raise
    conn.deadline, conn.max_meta = None, MAX_META_BYTES
    conn.set_timeout(HANDSHAKE_S)  # not what the deadline left: the server sets its own
    return conn, hello
