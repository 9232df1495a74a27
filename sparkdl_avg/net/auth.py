"""The mutual HMAC-SHA256 challenge-response every connection starts with, under per-role keys.

Only the server (and the driver that starts it) holds the shared secret. Every client holds
the key of one role, derived from it: the driver `HMAC(secret, "driver")`, worker 7
`HMAC(secret, "worker:7")` (`role_key`). The server challenges with a nonce; the client
answers with its own nonce, the role it claims, its hello and a MAC over them under that
role's key; the server derives the key of the claimed role, checks the MAC and proves itself
back. The authenticated role is kept on the connection (`Connection.role`) and `check_role`
ties the hello's id to it, so a worker's key can neither act as the driver nor as another
worker. Strangers get `HANDSHAKE_S` in total and `HANDSHAKE_META_BYTES` to parse, and what
they send is never counted under a reason of their choosing.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sparkdl_avg._errors import ProtocolError
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.frames import MAX_META_BYTES, Connection

HANDSHAKE_S = 10.0
"""A peer has this long, in total, to authenticate."""
HANDSHAKE_META_BYTES = 4096
"""Metadata limit before a peer has authenticated: strangers get little to parse."""
_NONCE_BYTES = 32


DRIVER_ROLE = "driver"


def new_secret() -> bytes:
    return os.urandom(32)


def role_of(worker: int) -> str:
    """The role of a worker id; a negative one (the parameter server's -1) is the driver."""
    return DRIVER_ROLE if worker < 0 else f"worker:{worker}"


def role_key(secret: bytes, role: str) -> bytes:
    """The key of `role`, derived from the shared secret (only its holder can derive it)."""
    return hmac.new(secret, role.encode(), hashlib.sha256).digest()


def worker_keys(secret: bytes, workers: int) -> tuple[bytes, ...]:
    """Workers 0..workers-1's keys, by rank. No task gets them all: each claims its own from
    the driver's load monitor (`task.enrolment`)."""
    return tuple(role_key(secret, role_of(rank)) for rank in range(workers))


@dataclass(frozen=True, slots=True)
class Credential:
    """What a client proves itself with: a role and that role's key (not the secret)."""

    role: str
    key: bytes = field(repr=False)

    @classmethod
    def of(cls, secret: bytes, worker: int) -> Credential:
        """The credential of worker id `worker` (negative: the driver's), from the secret."""
        role = role_of(worker)
        return cls(role, role_key(secret, role))


def check_role(role: str, hello: dict[str, Any]) -> None:
    """The id a hello claims (a parameter server's "worker", a sync worker's "rank") must be
    the authenticated role's own: refused (reason "role"). Every request on the connection
    then acts as that id, and only the driver's id may INIT or STOP."""
    claimed = hello.get("worker", hello.get("rank"))
    if isinstance(claimed, int) and role != role_of(claimed):
        raise ProtocolError(f"the key of {role} cannot act as {role_of(claimed)}", "role")


def _mac(secret: bytes, *parts: bytes) -> str:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).hexdigest()


def _hello_bytes(hello: dict[str, Any]) -> bytes:
    return json.dumps(hello, sort_keys=True).encode()


def authenticate_client(conn: Connection, secret: bytes,
                        on_auth: Callable[[], None] | None = None) -> dict[str, Any]:
    """Server side: the peer must prove it holds the key of the role it claims; then we prove
    it back. Sets `conn.role` and returns the peer's hello (authenticated, not yet validated:
    that is the server's own message). `on_auth`: called once a well-formed AUTH arrived."""
    nonce = os.urandom(_NONCE_BYTES)
    msg.send(conn, msg.Challenge(nonce=nonce.hex()))
    auth, _ = msg.receive(conn)
    if not isinstance(auth, msg.Auth):  # an ERROR's reason and text are the peer's: unused
        raise ProtocolError(f"expected AUTH, got {auth.KIND.name}", "unexpected")
    if on_auth is not None:
        on_auth()
    key = role_key(secret, auth.role)
    expected = _mac(key, b"client", nonce, auth.role.encode(), _hello_bytes(auth.hello))
    if not hmac.compare_digest(auth.mac, expected):
        raise ProtocolError("authentication failed (wrong secret or key)", "auth")
    check_role(auth.role, auth.hello)
    msg.send(conn, msg.Welcome(mac=_mac(key, b"server", bytes.fromhex(auth.nonce))))
    conn.role = auth.role
    return auth.hello


def authenticate_to_server(conn: Connection, secret: bytes | Credential,
                           hello: msg.Message) -> None:
    """Client side of `authenticate_client`; `hello` travels authenticated. `secret`: a
    role's `Credential`, or the shared secret (its holder derives the key of the role its
    hello names: a parameter-server id, else a rank)."""
    if not isinstance(secret, Credential):
        claimed = hello.to_meta()
        claimed = claimed.get("worker", claimed.get("rank"))
        secret = Credential.of(secret, claimed if isinstance(claimed, int) else -1)
    role, key = secret.role, secret.key
    challenge, _ = msg.expect(conn, msg.Challenge)
    mine = os.urandom(_NONCE_BYTES)
    meta = hello.to_meta()
    mac = _mac(key, b"client", bytes.fromhex(challenge.nonce), role.encode(),
               _hello_bytes(meta))
    msg.send(conn, msg.Auth(nonce=mine.hex(), mac=mac, role=role, hello=meta))
    welcome, _ = msg.expect(conn, msg.Welcome)
    if not hmac.compare_digest(welcome.mac, _mac(key, b"server", mine)):
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


def accept(sock: socket.socket, secret: bytes, *, tls: ssl.SSLContext | None = None,
           on_auth: Callable[[], None] | None = None) -> tuple[Connection, dict[str, Any]]:
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
        hello = authenticate_client(conn, secret, on_auth)
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
