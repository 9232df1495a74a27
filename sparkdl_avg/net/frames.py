"""Frames: the binary wire between the driver, the workers and the parameter server.

A frame is a fixed header, a small JSON object (`meta`) and an optional raw payload:

    magic "SDLA" | version u8 | kind u8 | flags u16 | meta_len u32 | payload_len u64

Tensors travel as raw bytes in the payload; their dtype and size are checked against what
the receiver expects before a byte is read into its buffer. Between two processes on one
host that have mapped each other's region (`shared_memory`), the flag SHARED says that the
payload is the first payload_len bytes of the sender's region, and none follow the header.
Nothing on the wire is ever unpickled. What `meta` may hold is defined per kind in
`messages`; authentication in `auth`.
"""

from __future__ import annotations

import contextlib
import enum
import json
import socket
import ssl
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparkdl_avg._errors import PeerClosed, ProtocolError
from sparkdl_avg.net.shared_memory import SharedRegion

MAGIC = b"SDLA"
VERSION = 9
"""2: typed messages (`messages`), SETTINGS and FAILED frames. 3: async evaluation on the
workers (EVALUATE, FINISHED, and the evaluation fields of PULL, PARAMS, ACK and EVAL). 4:
STATS carries `checkpoint_error` (a version 3 peer would refuse every STATS with "no
fields", mid-fit; the handshake now refuses it at once, with the reason `version`). 5: EVAL
carries `loss_weight` and `scored` (the eval loss and accuracy over weighted rows, ignored
positions and several outputs). 6: AUTH names the role whose key made its MAC (`auth`). 7:
EVAL carries the evaluation metrics' sums (`metrics`) and their score tables (`ranked`, with
a payload), and the first AVERAGE may ask for an evaluation before training; PUSH and
AVERAGE carry `encoding` (compressed deltas), AVERAGE `global_follows`, REPORT `outer_norm`
(`TrainConfig.outer_optimizer`, `delta_compression`). 8: the flag SHARED; WORKER hellos,
PUSH and the first AVERAGE name shared-memory regions (`TrainConfig.shared_memory`). 9: INIT
carries `gradients`, the leading values a gradient moves (DC-ASGD applies the statistics
after them as Downpour does)."""
HEADER = struct.Struct("!4sBBHIQ")
MAX_META_BYTES = 1 << 20
_CHUNK = 1 << 20
SHARED = 1
"""Flag: the payload lies at the start of the sender's shared region (`shared_memory`)."""


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
    # the parameter server's answer to INIT; a worker's own failure
    SETTINGS = 16
    FAILED = 17
    # async evaluation: the driver asks for one; a worker past its last push waits for one
    EVALUATE = 18
    FINISHED = 19
    # early stopping of an async fit (the driver to the parameter server)
    STOP = 20
    # the collective transport (sync): a worker's round, the driver's orders, the average
    REPORT = 21
    ORDERS = 22
    AVERAGED = 23
    # a task's own worker key, claimed from the driver's load monitor (`task.enrolment`)
    KEY = 24


@dataclass(frozen=True, slots=True)
class Frame:
    kind: Kind
    meta: dict[str, Any]
    payload: memoryview | None = None


Into = np.ndarray | Callable[[Kind, dict], np.ndarray | None] | None


class Connection:
    """One peer: framed messages over a socket, every call bounded by `timeout` seconds."""

    def __init__(self, sock: socket.socket, *, timeout: float, max_payload: int,
                 max_meta: int = MAX_META_BYTES) -> None:
        self.max_meta = max_meta
        self.deadline: float | None = None
        """If set (time.monotonic()), reads past it fail: a slow drip cannot hold us."""
        sock.settimeout(timeout)
        self._timeout = timeout
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.max_payload = max_payload
        self.bytes_moved = 0
        """Bytes sent and received so far, frames and payloads."""
        self.role: str | None = None
        """The peer's authenticated role, on a server's side (`auth`); None before."""
        self.shared_out: SharedRegion | None = None
        """A region the peer has mapped: a payload that *is* its start is only named."""
        self.shared_in: SharedRegion | None = None
        """The peer's region, mapped here: where its SHARED payloads are read."""

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        if self.shared_in is not None:  # the peer's region, mapped for this connection
            self.shared_in.close()

    def end_reads(self) -> None:
        """Make this connection's handler (another thread) see its peer gone at its next read,
        without closing the socket under it: it may be mid-send (a close from there failed
        that send with EBADF, and an applied update lost its ACK); it closes the socket
        itself. The plain socket's shutdown, even under TLS: the SSL socket's own would drop
        its TLS state while the handler sends."""
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.sock, socket.SHUT_RD)

    def set_timeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)
        self._timeout = timeout

    @property
    def timeout(self) -> float | None:
        """How long one read may wait (`set_timeout`)."""
        return self._timeout

    @contextlib.contextmanager
    def within(self, seconds: float | None):
        """Reads in the block must all be done `seconds` from now: a peer that sends a message
        a byte at a time holds us one wait, not one wait a byte. None: no deadline."""
        if seconds is None:
            yield
            return
        self.deadline = time.monotonic() + seconds
        try:
            yield
        finally:
            self.deadline = None
            with contextlib.suppress(OSError):  # closed meanwhile
                self.sock.settimeout(self._timeout)

    def send(self, kind: Kind, meta: dict[str, Any] | None = None, payload: Any = None) -> None:
        body = json.dumps(meta or {}, separators=(",", ":")).encode()
        view = memoryview(payload).cast("B") if payload is not None else None
        size = view.nbytes if view is not None else 0
        shared = view is not None and self.shared_out is not None and self.shared_out.holds(view)
        self.sock.sendall(HEADER.pack(MAGIC, VERSION, kind, SHARED if shared else 0, len(body),
                                      size) + body)
        if view is not None and not shared:
            self.sock.sendall(view)
        self.bytes_moved += HEADER.size + len(body) + size

    def recv(self, into: Into = None) -> Frame:
        """Read one frame. The payload goes into `into` (an array, or a function of the frame's
        kind and metadata returning one, or raising to refuse it unread) whose size it must
        match exactly; without a target it goes into a fresh buffer of at most `max_payload`
        bytes."""
        magic, version, kind, flags, meta_len, payload_len = HEADER.unpack(
            self._read_exact(HEADER.size))
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {magic!r}: the peer does not speak this protocol",
                                "magic")
        if version != VERSION:
            raise ProtocolError(f"protocol version {version} is not supported (want "
                                f"{VERSION})", "version")
        try:
            kind = Kind(kind)
        except ValueError:
            raise ProtocolError(f"unknown frame kind {kind}", "kind") from None
        if flags & ~SHARED:
            raise ProtocolError(f"unknown frame flags {flags:#x}")
        if meta_len > self.max_meta:
            raise ProtocolError(f"metadata of {meta_len} bytes exceeds {self.max_meta}",
                                "oversized")
        try:
            meta = json.loads(self._read_exact(meta_len)) if meta_len else {}
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(f"metadata is not JSON: {exc}") from None
        if not isinstance(meta, dict):
            raise ProtocolError("metadata must be a JSON object")
        if payload_len == 0:
            return Frame(kind, meta)
        if kind is Kind.ERROR:  # refused unread: the stream is out of step, so it ends
            raise ProtocolError(f"an ERROR frame carries no payload; this one claims "
                                f"{payload_len} bytes", "oversized")
        shared = None
        if flags & SHARED:
            shared = self.shared_in
            if shared is None:
                raise ProtocolError("a payload in shared memory, on a connection that shares "
                                    "none")
            if payload_len > shared.nbytes:
                raise ProtocolError(f"a shared payload of {payload_len} bytes in a region of "
                                    f"{shared.nbytes}", "oversized")
        if callable(into):
            into = into(kind, meta)
        if into is not None:
            if payload_len != into.nbytes:
                raise ProtocolError(f"payload of {payload_len} bytes where {into.nbytes} were "
                                    "expected (a different model or dtype on the other side?)",
                                    "shape")
            target = memoryview(into).cast("B")
            if shared is None:
                self._read_into(target)
            else:
                if not shared.holds(target):  # else it is read where it lies
                    target[:] = shared.data[:payload_len]
                self.bytes_moved += payload_len
            return Frame(kind, meta, target)
        if payload_len > self.max_payload:
            raise ProtocolError(f"payload of {payload_len} bytes exceeds the limit of "
                                f"{self.max_payload}", "oversized")
        if shared is not None:
            self.bytes_moved += payload_len
            return Frame(kind, meta, memoryview(bytearray(shared.data[:payload_len])))
        # Grown as bytes arrive: a header that claims much and sends little costs little.
        buffer = bytearray()
        while len(buffer) < payload_len:
            part = bytearray(min(payload_len - len(buffer), max(_CHUNK, len(buffer))))
            self._read_into(memoryview(part))
            buffer += part
        return Frame(kind, meta, memoryview(buffer))

    def _read_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        self._read_into(memoryview(buf))
        return bytes(buf)

    def _read_into(self, view: memoryview) -> None:
        pos = 0
        while pos < len(view):
            if self.deadline is not None:  # a total deadline: each read gets what is left
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the peer is too slow")
                self.sock.settimeout(left)
            got = self.sock.recv_into(view[pos:], len(view) - pos)
            if got == 0:
                raise PeerClosed()
            pos += got
            self.bytes_moved += got


def connect(address: tuple[str, int], *, timeout: float, max_payload: int,
            tls: ssl.SSLContext | None = None, tries: int = 1,
            until: float | None = None) -> Connection:
    """`timeout` bounds the TCP connect and, after it, each call. `tries` > 1: that many
    connects at once, the first to complete kept (`net.dial`). `until` (time.monotonic()):
    the handshake's deadline, set on the connection (`Connection.deadline`, for the caller
    to clear) and bounding TLS, which comes after the TCP connect and is not held to its
    limit (the server wraps under its own handshake deadline)."""
    if tries > 1:
        from sparkdl_avg.net.dial import first_connected  # dial knows nothing of frames

        sock = first_connected(address, tries, timeout)
    else:
        sock = socket.create_connection(address, timeout=timeout)
    try:
        sock.settimeout(timeout if until is None else max(0.001, until - time.monotonic()))
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=address[0])
        conn = Connection(sock, timeout=sock.gettimeout(), max_payload=max_payload)
    except BaseException:
        sock.close()
        raise
    conn.deadline = until
    return conn
