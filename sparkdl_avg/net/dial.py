"""Connecting to a server that may be busy: each attempt bounded, a failed one retried after a
jittered, growing pause, all within one deadline (a worker's connect_timeout).

A server under a connection flood drops the oldest strangers' handshakes and, past its listen
queue, SYNs; a client caught in either sees its connection closed, reset or timed out, or a
refusal for "capacity", and tries again. Refusals that a retry would only repeat (a wrong key,
a wrong version) are raised at once.
"""

from __future__ import annotations

import contextlib
import random
import selectors
import socket
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
FIRST_HANDSHAKE_S = 2.0
"""The handshake's limit once connected, doubling with each attempt: a busy server gets
longer."""
_PASSING = ("capacity", "timeout", "closed")


def retryable(exc: BaseException) -> bool:
    """A failure that may pass: a lost, reset or timed-out connection, or a busy server."""
    if isinstance(exc, ProtocolError):
        return exc.reason in _PASSING
    return isinstance(exc, OSError)


def pause_s(attempt: int) -> float:
    """The pause after failed attempt `attempt` (0 first): doubling, bounded, jittered so
    that workers dropped together do not come back together."""
    return random.uniform(0.5, 1.0) * min(MAX_PAUSE_S, FIRST_PAUSE_S * 2 ** attempt)


def first_connected(address: tuple[str, int], tries: int, timeout_s: float) -> socket.socket:
    """A TCP connection to `address`: `tries` connects at once, the first to complete kept
    (blocking), the others closed."""
    family, kind, proto, _, target = socket.getaddrinfo(*address, type=socket.SOCK_STREAM)[0]
    socks = [socket.socket(family, kind, proto) for _ in range(tries)]
    try:
        with selectors.DefaultSelector() as waiting:
            for sock in socks:
                sock.setblocking(False)
                sock.connect_ex(target)
                waiting.register(sock, selectors.EVENT_WRITE)
            deadline = time.monotonic() + timeout_s
            error = 0
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
            raise ConnectionRefusedError(error, f"cannot connect to {address[0]}:{address[1]}")
    finally:
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()


def dial(attempt_once: Callable[[float, float, int], T], limit_s: float) -> T:
    """`attempt_once(connect_s, handshake_s, tries)` until it succeeds; the last failure is
    raised when it cannot be retried or `limit_s` has passed."""
    deadline = time.monotonic() + limit_s
    attempt = 0
    while True:
        left = max(0.01, deadline - time.monotonic())
        try:
            return attempt_once(min(left, FIRST_CONNECT_S * 1.5 ** attempt, MAX_CONNECT_S),
                                min(left, FIRST_HANDSHAKE_S * 2 ** attempt),
                                min(MAX_TRIES, 2 ** attempt))
        except Exception as exc:
            pause = pause_s(attempt)
            if not retryable(exc) or time.monotonic() + pause >= deadline:
                raise
        time.sleep(pause)
        attempt += 1
