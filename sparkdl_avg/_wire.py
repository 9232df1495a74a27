"""The binary wire between the driver and the workers: framed, versioned, authenticated.

A frame is a fixed header, a small JSON object (`meta`) and an optional raw payload:

    magic "SDLA" | version u8 | kind u8 | reserved u16 | meta_len u32 | payload_len u64

Tensors travel as raw bytes in the payload; their dtype and size are in `meta` and are
checked against what the receiver expects before a byte is read into its buffer. Nothing
on the wire is ever unpickled. Each connection starts with a mutual HMAC-SHA256
challenge-response over a per-fit secret, so only the fit's own workers can join and a
worker only trusts its own driver.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import hmac
import json
import os
import socket
import ssl
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparkdl_avg._errors import ProtocolError

MAGIC = b"SDLA"
VERSION = 1
_HEADER = struct.Struct("!4sBBHIQ")
MAX_META_BYTES = 1 << 20
HANDSHAKE_META_BYTES = 4096
"""Metadata limit before a peer has authenticated: strangers get little to parse."""
_NONCE_BYTES = 32


class PeerClosed(ProtocolError):
    """The peer closed the connection (it ended, crashed or was restarted)."""


def peer_gone(exc: BaseException) -> bool:
    """A socket-level loss (reset, refused, closed, timed out), not a protocol violation:
    reconnecting may help."""
    return isinstance(exc, PeerClosed) or (isinstance(exc, OSError)
                                           and not isinstance(exc, ProtocolError))


class Kind(enum.IntEnum):
    CHALLENGE = 1
    AUTH = 2
    WELCOME = 3
    PUSH = 4
    AVERAGE = 5
    EVAL = 6
    DONE = 7
    ERROR = 8
    # the asynchronous parameter server
    PULL = 9
    PARAMS = 10
    UPDATE = 11
    ACK = 12
    STATS = 13
    INIT = 14
    # checkpoints of synchronous fits
    STATE = 15


@dataclass(frozen=True, slots=True)
class Frame:
    kind: Kind
    meta: dict[str, Any]
    payload: memoryview | None = None


Into = np.ndarray | Callable[[Kind, dict], np.ndarray | None] | None


def new_secret() -> bytes:
    return os.urandom(32)


def _mac(secret: bytes, *parts: bytes) -> str:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).hexdigest()


class Connection:
    """One peer: framed messages over a socket, every call bounded by `timeout` seconds."""

    def __init__(self, sock: socket.socket, *, timeout: float, max_payload: int,
                 max_meta: int = MAX_META_BYTES) -> None:
        self.max_meta = max_meta
        self.deadline: float | None = None
        """If set (time.monotonic()), reads past it fail: a slow drip cannot hold us."""
        sock.settimeout(timeout)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.max_payload = max_payload

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def set_timeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def send(self, kind: Kind, meta: dict[str, Any] | None = None, payload: Any = None) -> None:
        body = json.dumps(meta or {}, separators=(",", ":")).encode()
        view = memoryview(payload).cast("B") if payload is not None else None
        size = view.nbytes if view is not None else 0
        self.sock.sendall(_HEADER.pack(MAGIC, VERSION, kind, 0, len(body), size) + body)
        if view is not None:
            self.sock.sendall(view)

    def recv(self, into: Into = None) -> Frame:
        """Read one frame. The payload goes into `into` (an array, or a function of the frame's
        kind and metadata returning one) whose size it must match exactly; without a target
        it goes into a fresh buffer of at most `max_payload` bytes."""
        magic, version, kind, _, meta_len, payload_len = _HEADER.unpack(
            self._read_exact(_HEADER.size)
        )
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {magic!r}: the peer does not speak this protocol")
        if version != VERSION:
            raise ProtocolError(f"protocol version {version} is not supported (want {VERSION})")
        try:
            kind = Kind(kind)
        except ValueError:
            raise ProtocolError(f"unknown frame kind {kind}") from None
        if meta_len > self.max_meta:
            raise ProtocolError(f"metadata of {meta_len} bytes exceeds {self.max_meta}")
        try:
            meta = json.loads(self._read_exact(meta_len)) if meta_len else {}
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(f"metadata is not JSON: {exc}") from None
        if not isinstance(meta, dict):
            raise ProtocolError("metadata must be a JSON object")
        if kind is Kind.ERROR:
            return Frame(kind, meta)
        if payload_len == 0:
            return Frame(kind, meta)
        if callable(into):
            into = into(kind, meta)
        if into is not None:
            if payload_len != into.nbytes:
                raise ProtocolError(
                    f"payload of {payload_len} bytes where {into.nbytes} were expected "
                    "(a different model or dtype on the other side?)"
                )
            target = memoryview(into).cast("B")
        else:
            if payload_len > self.max_payload:
                raise ProtocolError(
                    f"payload of {payload_len} bytes exceeds the limit of {self.max_payload}"
                )
            target = memoryview(bytearray(payload_len))
        self._read_into(target)
        return Frame(kind, meta, target)

    def expect(self, kind: Kind, into: Into = None) -> Frame:
        frame = self.recv(into)
        if frame.kind is Kind.ERROR:
            raise ProtocolError(f"peer reported an error: {frame.meta.get('message', '?')}")
        if frame.kind is not kind:
            raise ProtocolError(f"expected a {kind.name} frame, got {frame.kind.name}")
        return frame

    def _read_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        self._read_into(memoryview(buf))
        return bytes(buf)

    def _read_into(self, view: memoryview) -> None:
        pos = 0
        while pos < len(view):
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise TimeoutError("the peer is too slow")
            got = self.sock.recv_into(view[pos:], len(view) - pos)
            if got == 0:
                raise PeerClosed("connection closed by the peer")
            pos += got

    # --- authentication -------------------------------------------------------------------

    def authenticate_client(self, secret: bytes) -> dict[str, Any]:
        """Server side: the peer must prove it knows `secret`; then we prove it back."""
        nonce = os.urandom(_NONCE_BYTES)
        self.send(Kind.CHALLENGE, {"nonce": nonce.hex()})
        frame = self.expect(Kind.AUTH)
        client_nonce, mac = frame.meta.get("nonce"), frame.meta.get("mac")
        hello = frame.meta.get("hello")
        if not (isinstance(client_nonce, str) and isinstance(mac, str) and isinstance(hello, dict)):
            raise ProtocolError("malformed AUTH frame")
        hello_bytes = json.dumps(hello, sort_keys=True).encode()
        if not hmac.compare_digest(mac.encode(), _mac(secret, b"client", nonce,
                                                      hello_bytes).encode()):
            self.send(Kind.ERROR, {"message": "authentication failed"})
            raise ProtocolError("a peer failed authentication (wrong secret)")
        try:
            client_nonce_bytes = bytes.fromhex(client_nonce)
        except ValueError:
            raise ProtocolError("malformed AUTH nonce") from None
        self.send(Kind.WELCOME, {"mac": _mac(secret, b"server", client_nonce_bytes)})
        return hello

    def authenticate_to_server(self, secret: bytes, hello: dict[str, Any]) -> None:
        """Client side of `authenticate_client`; `hello` travels authenticated."""
        frame = self.expect(Kind.CHALLENGE)
        try:
            nonce = bytes.fromhex(frame.meta["nonce"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError("malformed CHALLENGE frame") from None
        mine = os.urandom(_NONCE_BYTES)
        hello_bytes = json.dumps(hello, sort_keys=True).encode()
        mac = _mac(secret, b"client", nonce, hello_bytes)
        self.send(Kind.AUTH, {"nonce": mine.hex(), "mac": mac, "hello": hello})
        welcome = self.expect(Kind.WELCOME)
        expected = _mac(secret, b"server", mine).encode()
        if not hmac.compare_digest(str(welcome.meta.get("mac")).encode(), expected):
            raise ProtocolError("the server failed authentication (wrong secret)")


HANDSHAKE_S = 10.0
"""A peer has this long, in total, to authenticate."""


def accept(sock: socket.socket, secret: bytes, *, tls: ssl.SSLContext | None = None
           ) -> tuple[Connection, dict[str, Any]]:
    """Server side of a new connection: TLS (optional), then the HMAC handshake, all within
    HANDSHAKE_S and a small metadata limit, so a stranger can neither stall nor flood us.
    Returns the connection (limits reset to normal) and the peer's authenticated hello; the
    socket is closed if anything fails."""
    conn = None
    try:
        if tls is not None:
            sock.settimeout(HANDSHAKE_S)
            sock = tls.wrap_socket(sock, server_side=True)
        conn = Connection(sock, timeout=HANDSHAKE_S, max_payload=0,
                          max_meta=HANDSHAKE_META_BYTES)
        conn.deadline = time.monotonic() + HANDSHAKE_S
        hello = conn.authenticate_client(secret)
    except BaseException:
        (conn or sock).close()
        raise
    conn.deadline, conn.max_meta = None, MAX_META_BYTES
    return conn, hello


def connect(address: tuple[str, int], *, timeout: float, max_payload: int,
            tls: ssl.SSLContext | None = None) -> Connection:
    sock = socket.create_connection(address, timeout=timeout)
    if tls is not None:
        try:
            sock = tls.wrap_socket(sock, server_hostname=address[0])
        except BaseException:
            sock.close()
            raise
    return Connection(sock, timeout=timeout, max_payload=max_payload)
