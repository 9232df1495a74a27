"""One server base for the driver's coordinator and the parameter server.

It listens and accepts; every connection's handshake runs on a bounded pool of handler
threads under one total deadline, so a slow stranger holds up nobody. At most `max_pending`
handshakes run at once: when a new connection finds them full, the oldest stranger (one that
has not sent a well-formed AUTH) is dropped, never a client whose AUTH is being checked (so
strangers cannot lock workers out from one address, and all tests come from 127.0.0.1);
clients retry a dropped connect (`net.dial`). The listen queue is long (`BACKLOG`): a burst
waits there instead of losing its SYNs, and a connection whose peer closed it before sending
a byte (a flood's connect-and-close) is dropped in the accept loop itself, without a handler
thread, so the queue drains as fast as such a flood fills it. Authenticated connections go
to the subclass's `serve`, at most `max_connections` of them, with their role on the
connection (`Connection.role`). Every refusal is answered with an ERROR frame where the peer
can still read one, counted by its reason code and logged escaped (`escaped`): what a peer
sends never forges a log line. The accept loop survives every error it can; running out of
file descriptors is logged and backed off; an error it cannot survive is kept in `failure`
for the owner to act on. `close()` stops accepting and closes every connection; the
constructor starts nothing.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import selectors
import socket
import ssl
import threading
import time
from typing import Any

from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.auth import accept, refusal_reason
from sparkdl_avg.net.frames import Connection

log = logging.getLogger("sparkdl_avg")
_POLL_S = 0.25
_JOIN_S = 5.0
_BACKOFF_S = 0.5
_IDLE_THREAD_S = 30.0
_LOG_EVERY_S = 1.0
MAX_PENDING = 64
BACKLOG = 1024
"""The listen queue (the kernel caps it at net.core.somaxconn): a connection flood that
overflows it drops SYNs, and a dropped SYN costs a client a 1 s retransmission."""
_LOGGED_CHARS = 300
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_BROKEN_LISTENER = {errno.EBADF, errno.EINVAL, errno.ENOTSOCK, errno.EOPNOTSUPP}
"""accept() errors that no retry cures; any other (a peer's reset, a firewall's EPERM, out of
descriptors) concerns one connection or passes, and accept(2) says to retry."""


class Server:
    def __init__(self, *, secret: bytes, host: str = "127.0.0.1", port: int = 0,
                 tls: ssl.SSLContext | None = None, max_connections: int = 64,
                 max_pending: int = MAX_PENDING, name: str = "sparkdl-avg") -> None:
        self._secret, self._tls = secret, tls
        self._host, self._port, self._name = host, port, name
        self._max_connections, self._max_pending = max_connections, max_pending
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self._lock = threading.Condition()
        """Guards the subclass's state too: one lock, one condition to wait on."""
        self._conns: set[Connection] = set()
        self._pending: dict[socket.socket, socket.socket] = {}
        """Sockets in their handshake, oldest first, each with a duplicate descriptor that
        can still shut it down once TLS has wrapped (and detached) the original."""
        self._vouched: set[socket.socket] = set()
        """Pending sockets that sent a well-formed AUTH: dropped only after every stranger."""
        self._pool = _HandlerPool(max_connections + max_pending, name)
        self._accept_thread: threading.Thread | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None
        """A socket pair the accept loop also waits on: `stop_accepting` wakes it at once."""
        self.refused: collections.Counter[str] = collections.Counter()
        self._last_log: dict[str, tuple[float, int]] = {}
        self.failure: BaseException | None = None
        """Why the accept loop stopped for good (None while it runs): the server accepts no
        one any more, and its owner should stop (a parameter server's process exits)."""

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def address(self) -> tuple[str, int]:
        return self._host, self._port

    def start(self) -> None:
        self._listener = socket.create_server(
            (self._host, self._port),
            backlog=max(BACKLOG, self._max_connections + self._max_pending))
        self._listener.setblocking(False)
        # made here, not in the accept thread: it may start when descriptors have run out
        self._wake = socket.socketpair()
        self._ready = selectors.DefaultSelector()
        self._ready.register(self._listener, selectors.EVENT_READ)
        self._ready.register(self._wake[0], selectors.EVENT_READ)
        self._port = self._listener.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"{self._name}-accept")
        self._accept_thread.start()

    def stop_accepting(self) -> None:
        """No new connections from now on; the ones already served stay."""
        listener, self._listener = self._listener, None
        if listener is not None:
            # wakes the accept loop now, not at its next poll (closing alone does not wake
            # a thread blocked on the socket): an owner's close() returns at once
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        if self._wake is not None:
            with contextlib.suppress(OSError):  # the loop may have ended and closed it
                self._wake[1].send(b"x")
        with self._lock:
            for handle in list(self._pending.values()):
                _shutdown(handle)

    def close(self) -> None:
        self._closed.set()
        self.stop_accepting()
        with self._lock:
            for conn in list(self._conns):  # wakes any thread blocked on a socket
                conn.close()
            self._lock.notify_all()
        if self._accept_thread is not None and self._accept_thread is not \
                threading.current_thread():
            self._accept_thread.join(timeout=_JOIN_S)
        self._pool.close(_JOIN_S)

    def refusals(self) -> dict[str, int]:
        """The refusals so far by reason (a copy: handler threads keep counting)."""
        with self._lock:
            return dict(self.refused)

    def serve(self, conn: Connection, hello: dict[str, Any]) -> bool:
        """Serve one authenticated peer on a handler thread. Return True to keep the
        connection open after returning (the subclass then owns it until `close`)."""
        raise NotImplementedError

    def refuse(self, reason: str, why: object, who: object,
               conn: Connection | None = None) -> None:
        """Count a refusal by reason, log it (at most once a second per reason), and tell
        the peer when there is a connection to tell."""
        now = time.monotonic()
        with self._lock:
            self.refused[reason] += 1
            last, quiet = self._last_log.get(reason, (0.0, 0))
            loud = now - last >= _LOG_EVERY_S
            self._last_log[reason] = (now, 0) if loud else (last, quiet + 1)
        if loud:
            more = f" (and {quiet} more like it)" if quiet else ""
            log.warning("%s refused %s (%s): %s%s", self._name, escaped(who), reason,
                        escaped(why), more)
        if conn is not None:
            with contextlib.suppress(OSError):
                msg.send(conn, msg.Refusal(message=str(why)[:2000], reason=reason))

    def _accept_loop(self) -> None:
        """Accept until the queue is empty, then wait on it: one system call a connection
        while a burst lasts, none while idle."""
        try:
            with self._ready as ready:
                listener = self._listener
                if listener is None:
                    return
                while not self._closed.is_set() and self._listener is not None:
                    try:
                        sock, peer = listener.accept()
                    except BlockingIOError:
                        ready.select(_POLL_S)
                        continue
                    except OSError as exc:
                        if self._closed.is_set() or self._listener is None:
                            return
                        if exc.errno in _BROKEN_LISTENER:
                            raise
                        log.warning("%s cannot accept: %s; backing off", self._name, exc)
                        time.sleep(_BACKOFF_S if exc.errno in _OUT_OF_RESOURCES else 0.01)
                        continue
                    if _gone(sock):
                        sock.close()
                        self.refuse("closed", "connection closed by the peer before its "
                                    "handshake", peer)
                        continue
                    self._admit(sock, peer)
        except BaseException as exc:  # noqa: BLE001 - kept for the owner, who stops
            self.failure = exc
            log.error("%s stopped accepting connections: %r", self._name, exc)
        finally:
            for end in self._wake:
                end.close()

    def _admit(self, sock: socket.socket, peer) -> None:
        try:
            handle = sock.dup()
        except OSError as exc:  # out of descriptors: this one cannot be served now
            sock.close()
            log.warning("%s cannot take %s: %s", self._name, peer, exc)
            return
        dropped = None
        with self._lock:
            self._pending[sock] = handle
            if len(self._pending) > self._max_pending:  # the oldest stranger (else this one)
                oldest = next((s for s in self._pending if s not in self._vouched), sock)
                dropped = self._pending.pop(oldest)
        if dropped is not None:
            _shutdown(dropped)
            dropped.close()
            self.refuse("capacity", f"more than {self._max_pending} handshakes at once: "
                        "dropped the oldest stranger", "a stranger")
            if dropped is handle:
                sock.close()
                return
        try:
            self._pool.submit(self._handle, sock, peer)
        except RuntimeError:  # no handler thread could be started at all
            self._forget(sock)
            sock.close()
            raise

    def _forget(self, sock: socket.socket) -> bool:
        """Its handshake is over; False if it had been dropped for a newer one."""
        with self._lock:
            handle = self._pending.pop(sock, None)
            self._vouched.discard(sock)
        if handle is not None:
            handle.close()
        return handle is not None

    def _vouch(self, sock: socket.socket) -> None:
        """Its AUTH was well-formed: strangers are dropped before it."""
        with self._lock:
            if sock in self._pending:
                self._vouched.add(sock)

    def _handle(self, sock: socket.socket, peer) -> None:
        try:
            conn, hello = accept(sock, self._secret, tls=self._tls,
                                 on_auth=lambda: self._vouch(sock))
        except Exception as exc:  # noqa: BLE001 - every refusal is counted, none escapes
            if self._forget(sock):  # a dropped one was counted when it was dropped
                self.refuse(refusal_reason(exc), exc, peer)
            return
        if not self._forget(sock):  # dropped just as it finished: it is closed
            conn.close()
            return
        with self._lock:
            full = len(self._conns) >= self._max_connections
            if not full and not self._closed.is_set():
                self._conns.add(conn)
        if full or self._closed.is_set():
            self.refuse("capacity", f"{self._name} serves {self._max_connections} "
                        "connections already", peer, conn)
            conn.close()
            return
        keep = False
        try:
            keep = self.serve(conn, hello)
        finally:
            if not keep:
                with self._lock:
                    self._conns.discard(conn)
                conn.close()


class _HandlerPool:
    """At most `size` daemon threads running submitted calls; idle ones end after a while,
    and finished ones are forgotten."""

    def __init__(self, size: int, name: str) -> None:
        self._size, self._name = size, name
        self._jobs: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._threads: set[threading.Thread] = set()
        self._idle = 0
        self._closed = False

    def submit(self, fn, *args) -> None:
        with self._cond:
            self._jobs.append((fn, args))
            # idle threads may already be promised to earlier jobs: count jobs, not wakeups
            if len(self._jobs) > self._idle and len(self._threads) < self._size:
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"{self._name}-handler")
                try:
                    thread.start()
                except RuntimeError:
                    if not self._threads:
                        self._jobs.pop()
                        raise
                    log.warning("%s: no new handler thread; %d queued", self._name,
                                len(self._jobs))
                else:
                    self._threads.add(thread)
            self._cond.notify()

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while self._threads - {threading.current_thread()} and \
                    time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._idle += 1
                    woke = self._cond.wait(timeout=_IDLE_THREAD_S)
                    self._idle -= 1
                    if not woke and not self._jobs:
                        break
                if not self._jobs:
                    self._threads.discard(me)
                    self._cond.notify_all()
                    return
                fn, args = self._jobs.popleft()
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - one connection's bug must not end the pool
                log.exception("%s: a connection handler failed", self._name)


def escaped(value: object) -> str:
    """`value` as one printable ASCII line of bounded length: what a peer chose (a host, a
    field's value in an error) can neither forge log lines nor flood the log."""
    text = str(value)
    more = f"... ({len(text)} characters)" if len(text) > _LOGGED_CHARS else ""
    return ascii(text[:_LOGGED_CHARS])[1:-1] + more


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _gone(sock: socket.socket) -> bool:
    """The peer closed (or reset) the connection before the server read a byte: a flood's
    connect-and-close, dropped in the accept loop without a handler thread, so the listen
    queue drains as fast as the flood fills it. A peer that sent data first is not gone."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def peer_closed(sock: socket.socket) -> bool:
    """`_gone` for a socket TLS may have wrapped (an SSLSocket refuses recv flags): peeks on
    a duplicate of its descriptor, whose bytes are the raw stream's. A worker whose process
    died closed its connection, though the server may not have read from it since."""
    try:
        raw = socket.socket(fileno=os.dup(sock.fileno()))
    except OSError:  # closed already
        return True
    with raw:
        return _gone(raw)
