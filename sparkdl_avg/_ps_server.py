"""The asynchronous parameter server: pull parameters, push updates, over the same wire.

One thread per connected worker; the update rules live in `_async_rules` and run under one
lock. What a worker sends is checked before it touches the parameters: a wrong secret, a
malformed frame, an update of the wrong size or with NaN/Inf is refused with an ERROR reply
and counted by reason, and the server stays up. `staleness_bound` holds a worker's pulls until
it is at most that many pushes ahead of the slowest connected worker, and holds a push until
every other worker has read the parameters of that many clocks back; with a bound of 0 the
rounds are exactly synchronous.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import os
import socket
import ssl
import threading
import time

import numpy as np

from sparkdl_avg import _wire
from sparkdl_avg._async_rules import ServerState, may_apply, may_read
from sparkdl_avg._checkpoint import Writer
from sparkdl_avg._errors import ProtocolError

log = logging.getLogger("sparkdl_avg")
SECRET_ENV = "SPARKDL_AVG_PS_SECRET"
"""How a started server gets its secret (not the command line, which others can read)."""
DRIVER = -1
"""The worker id the driver uses: it sends INIT, pulls for evaluation, and is no SSP member."""


class ParameterServer:
    """Owns the listening socket, the worker threads and the parameters. `close()` stops all."""

    def __init__(self, state: ServerState | None = None, *, secret: bytes,
                 host: str = "127.0.0.1", port: int = 0, staleness_bound: int | None = None,
                 timeout: float = 600.0, settings: dict | None = None,
                 max_message_bytes: int = 1 << 32, tls: ssl.SSLContext | None = None,
                 checkpoint_path: str | None = None, checkpoint_every: int = 0) -> None:
        """`checkpoint_path`: save the state there at INIT and every `checkpoint_every`
        applied updates (0: at INIT only), so a restarted server resumes from it."""
        self.state = state
        """None until a driver sends INIT with the initial parameters and `settings`."""
        self._settings = settings or {}
        self._max_message = max_message_bytes
        self._tls = tls
        self._secret = secret
        self._host, self._port = host, port
        self._bound = staleness_bound
        self._timeout = timeout
        self._lock = threading.Condition()
        self._clocks: dict[int, int] = {}
        self._read_clocks: dict[int, int] = {}
        self._pulled_version: dict[int, int] = {}
        self.applied = 0
        self.samples = 0
        self.loss_sum = 0.0
        self.refused: collections.Counter[str] = collections.Counter()
        self.staleness: dict[int, list[int]] = collections.defaultdict(list)
        self._owners: dict[int, _wire.Connection] = {}
        self._announced = 0
        """Workers the driver's INIT announced (they count before they connect)."""
        self.progress: dict[int, int] = {}
        """Per worker: the local steps its applied pushes cover (where a restarted one
        resumes)."""
        self._checkpoint = Writer(functools.partial(_save_npz, checkpoint_path),
                                  f"the server checkpoint {checkpoint_path}") \
            if checkpoint_path else None
        self._checkpoint_every = checkpoint_every
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: set[_wire.Connection] = set()
        self._closed = threading.Event()

    def __enter__(self) -> ParameterServer:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def address(self) -> tuple[str, int]:
        return self._host, self._port

    def start(self) -> None:
        self._listener = socket.create_server((self._host, self._port), backlog=64)
        self._listener.settimeout(0.25)
        self._port = self._listener.getsockname()[1]
        self._spawn(self._accept_loop, "sparkdl-avg-ps-accept")

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            for conn in list(self._conns):
                conn.close()
            self._lock.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._checkpoint is not None:
            self._checkpoint.close()

    def restore(self, path: str) -> None:
        """Take up a checkpoint written by a server with the same settings (before start)."""
        with np.load(path, allow_pickle=False) as saved:
            meta = json.loads(saved["meta"].tobytes())
            params = saved["params"].copy()
            meansquare = saved["meansquare"].copy() if "meansquare" in saved else None
        self.state = ServerState(params=params, **self._settings)
        self.state.meansquare = meansquare
        self.applied, self.samples, self.loss_sum = (meta["applied"], meta["samples"],
                                                     meta["loss_sum"])
        self.progress = {int(w): int(s) for w, s in meta["progress"].items()}
        self.refused.update(meta["refused"])
        self._announce(int(meta.get("workers", 0)))
        log.info("resumed from %s: %d updates applied, progress %s", path, self.applied,
                 self.progress)

    def _save_checkpoint(self) -> None:
        """With the lock held: hand a copy of the state to the background writer."""
        if self._checkpoint is None or self.state is None:
            return
        arrays = {"params": self.state.params.copy()}
        if self.state.meansquare is not None:
            arrays["meansquare"] = self.state.meansquare.copy()
        meta = {"applied": self.applied, "samples": self.samples, "loss_sum": self.loss_sum,
                "progress": {str(w): s for w, s in self.progress.items()},
                "refused": dict(self.refused), "workers": self._announced}
        self._checkpoint.submit((arrays, meta))

    def stats(self) -> dict:
        with self._lock:
            staleness = {str(w): {"count": len(v), "mean": float(np.mean(v)) if v else 0.0,
                                  "max": max(v, default=0),
                                  "histogram": {str(k): n for k, n in
                                                sorted(collections.Counter(v).items())}}
                         for w, v in self.staleness.items()}
            return {"applied": self.applied, "refused": dict(self.refused),
                    "clocks": {str(w): c for w, c in self._clocks.items()},
                    "progress": {str(w): s for w, s in self.progress.items()},
                    "samples": self.samples, "loss_sum": self.loss_sum,
                    "staleness": staleness}

    def _spawn(self, target, name: str, *args) -> None:
        t = threading.Thread(target=target, name=name, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            self._spawn(self._serve, f"sparkdl-avg-ps-{peer[1]}", sock, peer)

    def _serve(self, sock: socket.socket, peer) -> None:
        try:
            conn, hello = _wire.accept(sock, self._secret, tls=self._tls)
        except Exception as exc:
            self._refuse("auth", exc, peer)
            return
        worker = hello.get("worker")
        if not isinstance(worker, int) or worker < DRIVER:
            self._refuse("auth", f"bad worker id {worker!r}", peer, conn)
            conn.close()
            return
        conn.max_payload = self._max_message if worker == DRIVER else 0
        conn.set_timeout(self._timeout)
        with self._lock:
            self._conns.add(conn)
            if worker != DRIVER:  # the driver pulls and inits but never holds others back
                start = min(self._clocks.values(), default=0)
                self._clocks.setdefault(worker, start)
                self._read_clocks.setdefault(worker, start - 1)  # has read nothing yet
                self._owners[worker] = conn  # a reconnect takes over from a stale connection
        try:
            self._serve_worker(conn, worker)
        finally:
            with self._lock:  # a gone worker no longer holds the others back
                self._conns.discard(conn)
                if self._owners.get(worker) is conn:
                    del self._owners[worker]
                    self._clocks.pop(worker, None)
                    self._read_clocks.pop(worker, None)
                self._lock.notify_all()
            conn.close()

    def _serve_worker(self, conn: _wire.Connection, worker: int) -> None:
        update = np.empty(0)  # this connection's receive buffer, sized to the model

        def into(kind: _wire.Kind, meta: dict) -> np.ndarray | None:
            nonlocal update
            if kind is not _wire.Kind.UPDATE:
                return None  # INIT (driver only) goes to a fresh buffer within max_payload
            if self.state is None:
                raise ProtocolError("the server has no parameters yet (no INIT)")
            if update.shape != self.state.params.shape:
                update = np.empty_like(self.state.params)
            return update

        while not self._closed.is_set():
            try:
                frame = conn.recv(into)
            except ProtocolError as exc:
                if not isinstance(exc, _wire.PeerClosed):
                    # Refused; the stream may be out of step, so this connection ends here.
                    self._refuse(_reason(exc), exc, worker, conn)
                return
            except (TimeoutError, OSError):
                return
            if frame.kind is _wire.Kind.PULL:
                if self.state is None:
                    _try_send_error(conn, "the server has no parameters yet (no INIT)")
                    continue
                with self._lock:
                    if worker != DRIVER and not self._wait_for(
                            lambda: may_read(self._clocks, worker, self._bound)):
                        _try_send_error(conn, "timed out waiting for slower workers")
                        return
                    params = self.state.pull(worker).copy()
                    version = self._pulled_version[worker] = self.applied
                    progress = self.progress.get(worker, 0)
                    if worker != DRIVER:
                        self._read_clocks[worker] = self._clocks[worker]
                        self._lock.notify_all()
                conn.send(_wire.Kind.PARAMS, {"version": version, "progress": progress}, params)
            elif frame.kind is _wire.Kind.UPDATE:
                self._apply(conn, worker, update, frame)
            elif frame.kind is _wire.Kind.INIT and worker == DRIVER:
                self._init(conn, frame)
            elif frame.kind is _wire.Kind.STATS:
                conn.send(_wire.Kind.STATS, self.stats())
            else:
                self._refuse("unexpected", f"unexpected {frame.kind.name} frame", worker, conn)

    def _apply(self, conn: _wire.Connection, worker: int, update: np.ndarray,
               frame: _wire.Frame) -> None:
        if frame.payload is None:
            self._refuse("malformed", "UPDATE without a payload", worker, conn)
            return
        if not np.isfinite(update).all():
            self._refuse("non_finite", "update holds NaN or Inf: refused", worker, conn)
            return
        with self._lock:
            clock = self._clocks.get(worker, 0)
            if not self._wait_for(
                    lambda: may_apply(self._read_clocks, worker, clock, self._bound)):
                _try_send_error(conn, "timed out waiting for slower workers")
                return
            try:
                self.state.apply(worker, update)
            except ValueError as exc:
                self._refuse("malformed", exc, worker, conn)
                return
            staleness = self.applied - self._pulled_version.get(worker, 0)
            self.applied += 1
            self.staleness[worker].append(staleness)
            self._clocks[worker] = clock + 1
            self._lock.notify_all()
            applied = self.applied
            meta = frame.meta
            if _is_count(meta.get("samples")) and isinstance(meta.get("loss_sum"), (int, float)):
                self.samples += meta["samples"]
                self.loss_sum += meta["loss_sum"]
            if _is_count(meta.get("steps")):
                self.progress[worker] = meta["steps"]
            if self._checkpoint_every and applied % self._checkpoint_every == 0:
                self._save_checkpoint()
        conn.send(_wire.Kind.ACK, {"applied": applied, "staleness": staleness})

    def _wait_for(self, condition) -> bool:
        """With the lock held: wait (bounded) until `condition()` or no bound is set."""
        if self._bound is None:
            return True
        deadline = time.monotonic() + self._timeout
        while not condition():
            if self._closed.is_set() or time.monotonic() > deadline:
                return False
            self._lock.wait(timeout=0.5)
        return True

    def _init(self, conn: _wire.Connection, frame: _wire.Frame) -> None:
        dtype = frame.meta.get("dtype")
        workers = frame.meta.get("workers", 0)
        if dtype not in ("float32", "float64") or frame.payload is None \
                or frame.payload.nbytes % np.dtype(dtype).itemsize or not _is_count(workers):
            self._refuse("malformed", f"malformed INIT: {frame.meta}", DRIVER, conn)
            return
        params = np.frombuffer(frame.payload, dtype=dtype).copy()
        with self._lock:
            self._announce(workers)
            self.state = ServerState(params=params, **self._settings)
            self.applied, self.samples, self.loss_sum = 0, 0, 0.0
            self.progress.clear()
            self._pulled_version.clear()
            self.staleness.clear()
            self._save_checkpoint()
        conn.send(_wire.Kind.ACK, {"applied": 0})

    def _announce(self, workers: int) -> None:
        """With the lock held: workers announced by the driver count for the staleness bound
        before they connect, so an early worker cannot run ahead of one still loading."""
        self._announced = workers
        for w in range(workers):
            self._clocks.setdefault(w, 0)
            self._read_clocks.setdefault(w, -1)  # no push applies before its first read

    def _refuse(self, reason: str, why: object, who,
                conn: _wire.Connection | None = None) -> None:
        """Count a refusal by reason (under the lock: many threads refuse), log it, and tell
        the peer when there is a connection to tell."""
        with self._lock:
            self.refused[reason] += 1
        log.warning("parameter server refused %s (%s): %s", who, reason, why)
        if conn is not None:
            _try_send_error(conn, str(why))


def _save_npz(path: str, item: tuple[dict, dict]) -> None:
    """Arrays and a JSON `meta` to `path`, through a temporary file and a rename, so a
    reader never sees half a checkpoint."""
    arrays, meta = item
    tmp = f"{path}.tmp.npz"
    np.savez(tmp, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    os.replace(tmp, path)


def _reason(exc: ProtocolError) -> str:
    text = str(exc)
    if "exceeds" in text:
        return "oversized"
    if "where" in text and "expected" in text:
        return "shape"
    return "malformed"


def _try_send_error(conn: _wire.Connection, message: str) -> None:
    with contextlib.suppress(OSError):
        conn.send(_wire.Kind.ERROR, {"message": message})


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
