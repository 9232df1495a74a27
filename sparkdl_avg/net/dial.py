"""Connecting to a server that may be busy: each attempt bounded, a failed one retried after a
jittered, growing pause, all within one deadline (a worker's connect_timeout).

A server under a connection flood drops the oldest strangers' handshakes and, past its listen
queue, SYNs; a client caught in either sees its connection closed, reset or timed out, or a
refusal for "capacity", and tries again. Failures that a retry would only repeat (a wrong key
or role, another protocol version, a certificate that does not verify, a name that does not
resolve) are raised at once.
"""

from __future__ import annotations

import contextlib
import errno
import random
import selectors
import socket
import ssl
import time
from collections.abc import Callable
from typing import TypeVar

from sparkdl_avg._errors import ProtocolError

T = TypeVar("T")
FIRST_PAUSE_S = 0.05
MAX_PAUSE_S = 1.0
FIRST_CONNECT_S = 0.2
MAX_CONNECT_S = 1.0
"""A TCP connect's limit: from 0.2 s, growing by half with each attempt, to 1 s. A SYN that
a full listen queue dropped is sent again by the kernel only after 1, 3, 7 and 15 s (the
19 s of issue 33), while the server's kernel answers one it queued within a round trip: a
fresh connect gets in sooner than waiting."""
MAX_TRIES = 8
"""Connects started at once, doubling with each attempt from one: under a flood each SYN has a
small chance of a place in the server's listen queue, and the first of several to get one
wins. The first attempt is a single connect, so a server that is not flooded sees one."""
_PASSING = ("capacity", "timeout", "closed")
_TLS_CLOSED = (ssl.SSLEOFError, ssl.SSLZeroReturnError)
"""A TLS handshake the server dropped (a flood's oldest stranger): it may pass."""


def retryable(exc: BaseException) -> bool:
    """A failure that may pass: a lost, reset or timed-out connection, or a busy server. A
    name that does not resolve or a certificate that does not verify would fail the same
    way again: raised at once."""
    if isinstance(exc, ProtocolError):
        return exc.reason in _PASSING
    if isinstance(exc, ssl.SSLError):
        return isinstance(exc, _TLS_CLOSED)
    return isinstance(exc, OSError) and not isinstance(exc, socket.gaierror)


def pause_s(attempt: int) -> float:
    """The pause after failed attempt `attempt` (0 first): doubling, bounded, jittered so
    that workers dropped together do not come back together."""
    return random.uniform(0.5, 1.0) * min(MAX_PAUSE_S, FIRST_PAUSE_S * 2 ** attempt)


def first_connected(address: tuple[str, int], tries: int, timeout_s: float) -> socket.socket:
    """A TCP connection to `address`: `tries` connects at once, spread over every address
    the name resolves to (at least one each), the first to complete kept (blocking), the
    others closed."""
    targets = socket.getaddrinfo(*address, type=socket.SOCK_STREAM)
    socks: list[socket.socket] = []
    error: int | None = None
    try:
        with selectors.DefaultSelector() as waiting:
            for i in range(max(tries, len(targets))):
                family, kind, proto, _, target = targets[i % len(targets)]
                try:
                    sock = socket.socket(family, kind, proto)
                except OSError as exc:  # a family this host lacks (IPv6 off): the others
                    error = exc.errno
                    continue
                socks.append(sock)
                sock.setblocking(False)
                started = sock.connect_ex(target)
                if started not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                    error = started  # refused at once (a closed port on this host)
                    continue
                waiting.register(sock, selectors.EVENT_WRITE)
            deadline = time.monotonic() + timeout_s
            while waiting.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"connecting to {address[0]}:{address[1]} timed out")
                for key, _ in waiting.select(left):
                    sock = key.fileobj
                    waiting.unregister(sock)
                    error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if not error:
                        socks.remove(sock)
                        sock.setblocking(True)
                        return sock
            raise ConnectionRefusedError(error or errno.ECONNREFUSED,
                                         f"cannot connect to {address[0]}:{address[1]}")
    finally:
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()


def dial(attempt_once: Callable[[float, float, int], T], limit_s: float,
         handshake_s: float) -> T:
    """`attempt_once(connect_s, until, tries)` until it succeeds: a TCP connect within
    `connect_s`, then the handshake by the time `until` (time.monotonic()), which gives it
    `handshake_s` (the server's own limit: less would give up on a server that still
    counts on us) and never passes `limit_s`. The last failure is raised when it cannot be
    retried or `limit_s` has passed."""
    deadline = time.monotonic() + limit_s
    attempt = 0
    while True:
        now = time.monotonic()
        connect_s = max(0.01, min(deadline - now, FIRST_CONNECT_S * 1.5 ** attempt,
                                  MAX_CONNECT_S))
        try:
            return attempt_once(connect_s, min(deadline, now + connect_s + handshake_s),
                                min(MAX_TRIES, 2 ** attempt))
        except Exception as exc:
            pause = pause_s(attempt)
            if not retryable(exc) or time.monotonic() + pause >= deadline:
                raise
        time.sleep(pause)
        attempt += 1
