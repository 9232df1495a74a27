"""One server base for the driver's coordinator and the parameter server.

It listens, accepts concurrently (every connection's handshake runs on its own thread, so a
slow stranger holds up nobody), authenticates each peer within the handshake deadline, and
hands authenticated connections to the subclass's `serve`. Refusals are counted by reason
code and logged. `close()` stops accepting and closes every connection; the constructor
starts nothing.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import ssl
import threading
import time
from typing import Any

from sparkdl_avg._errors import ProtocolError
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.auth import accept
from sparkdl_avg.net.frames import Connection

log = logging.getLogger("sparkdl_avg")
_POLL_S = 0.25
_JOIN_S = 5.0


class Server:
    def __init__(self, *, secret: bytes, host: str = "127.0.0.1", port: int = 0,
                 tls: ssl.SSLContext | None = None, backlog: int = 64,
                 name: str = "sparkdl-avg") -> None:
        self._secret, self._tls = secret, tls
        self._host, self._port, self._backlog, self._name = host, port, backlog, name
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self._lock = threading.Condition()
        """Guards the subclass's state too: one lock, one condition to wait on."""
        self._conns: set[Connection] = set()
        self._handshaking: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self.refused: collections.Counter[str] = collections.Counter()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def address(self) -> tuple[str, int]:
        return self._host, self._port

    def start(self) -> None:
        self._listener = socket.create_server((self._host, self._port), backlog=self._backlog)
        self._listener.settimeout(_POLL_S)
        self._port = self._listener.getsockname()[1]
        self._spawn(self._accept_loop, f"{self._name}-accept")

    def stop_accepting(self) -> None:
        """No new connections from now on; the ones already served stay."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def close(self) -> None:
        self._closed.set()
        self.stop_accepting()
        with self._lock:
            for conn in list(self._conns):  # wakes any thread blocked on a socket
                conn.close()
            for sock in list(self._handshaking):  # and any stranger mid-handshake
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self._lock.notify_all()
        current = threading.current_thread()
        deadline = time.monotonic() + _JOIN_S
        for t in list(self._threads):
            if t is not current:
                t.join(timeout=max(0.0, deadline - time.monotonic()))

    def serve(self, conn: Connection, hello: dict[str, Any]) -> bool:
        """Serve one authenticated peer on its own thread. Return True to keep the
        connection open after the thread ends (the subclass then owns it until `close`)."""
        raise NotImplementedError

    def refuse(self, reason: str, why: object, who: object,
               conn: Connection | None = None) -> None:
        """Count a refusal by reason, log it, and tell the peer when there is a connection
        to tell."""
        with self._lock:
            self.refused[reason] += 1
        log.warning("%s refused %s (%s): %s", self._name, who, reason, why)
        if conn is not None:
            with contextlib.suppress(OSError):
                msg.send(conn, msg.Refusal(message=str(why)[:2000], reason=reason))

    def _spawn(self, target, name: str, *args) -> None:
        def run() -> None:
            try:
                target(*args)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            self._threads.add(thread)
        try:
            thread.start()
        except RuntimeError:  # no thread to be had: refuse this one, keep accepting
            with self._lock:
                self._threads.discard(thread)
            raise

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            listener = self._listener
            if listener is None:
                return
            try:
                sock, peer = listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._closed.is_set() or self._listener is None:
                    return
                log.warning("%s cannot accept (%s); retrying", self._name, exc)
                time.sleep(_POLL_S)  # out of file descriptors: don't spin
                continue
            try:
                self._spawn(self._handle, f"{self._name}-{peer[1]}", sock, peer)
            except RuntimeError as exc:
                sock.close()
                log.warning("%s refused %s: %s", self._name, peer, exc)

    def _handle(self, sock: socket.socket, peer) -> None:
        with self._lock:
            self._handshaking.add(sock)
        try:
            conn, hello = accept(sock, self._secret, tls=self._tls)
        except ProtocolError as exc:
            self.refuse(exc.reason, exc, peer)
            return
        except TimeoutError as exc:
            self.refuse("timeout", exc, peer)
            return
        except (OSError, ValueError) as exc:  # a reset, a TLS failure
            self.refuse("auth", exc, peer)
            return
        finally:
            with self._lock:
                self._handshaking.discard(sock)
        with self._lock:
            if self._closed.is_set():
                conn.close()
                return
            self._conns.add(conn)
        keep = False
        try:
            keep = self.serve(conn, hello)
        finally:
            if not keep:
                with self._lock:
                    self._conns.discard(conn)
                conn.close()
