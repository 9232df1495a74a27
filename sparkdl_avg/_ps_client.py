"""A worker's connection to the parameter server: pull parameters, push updates."""

from __future__ import annotations

import ssl

import numpy as np

from sparkdl_avg import _wire
from sparkdl_avg._errors import ProtocolError


class ServerRefused(ProtocolError):
    """The server answered with an ERROR: it refused a request (a NaN update, a timeout
    waiting for slower workers). Unlike a lost connection, reconnecting does not help."""


class PSClient:
    def __init__(self, address: tuple[str, int], *, secret: bytes, worker: int, numel: int,
                 dtype: np.dtype, timeout: float, tls_ca_pem: str | None = None) -> None:
        """`tls_ca_pem`: PEM text of a CA (or the server's self-signed certificate): speak TLS
        and verify the server with it."""
        tls = ssl.create_default_context(cadata=tls_ca_pem) if tls_ca_pem else None
        self._conn = _wire.connect(address, timeout=timeout, max_payload=0, tls=tls)
        try:
            self._conn.authenticate_to_server(secret, {"worker": worker})
        except BaseException:
            self._conn.close()
            raise
        self.params = np.empty(numel, dtype)
        self.progress = 0
        """After a pull: the local steps of this worker the server has applied."""

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def pull(self) -> int:
        """Fetch the server's parameters into `self.params` (and this worker's `progress`);
        returns the server's version."""
        self._conn.send(_wire.Kind.PULL)
        meta = self._expect(_wire.Kind.PARAMS, into=self.params).meta
        self.progress = int(meta.get("progress", 0))
        return int(meta["version"])

    def push(self, update: np.ndarray, *, samples: int = 0, loss_sum: float = 0.0,
             steps: int | None = None) -> dict:
        """Send an update (the server applies w <- w - update by its rule); returns the ACK.
        `steps`: the worker's local steps including this update (its progress)."""
        meta = {"samples": samples, "loss_sum": loss_sum}
        if steps is not None:
            meta["steps"] = steps
        self._conn.send(_wire.Kind.UPDATE, meta, update)
        return self._expect(_wire.Kind.ACK).meta

    def _expect(self, kind: _wire.Kind, into: _wire.Into = None) -> _wire.Frame:
        frame = self._conn.recv(into)
        if frame.kind is _wire.Kind.ERROR:
            raise ServerRefused(f"the parameter server refused: {frame.meta.get('message')}")
        if frame.kind is not kind:
            raise ProtocolError(f"expected a {kind.name} frame, got {frame.kind.name}")
        return frame

    def init(self, params: np.ndarray, workers: int = 0) -> None:
        """Driver only: (re)start the server from these parameters, expecting workers
        0..workers-1 (they count for the staleness bound from now on)."""
        self._conn.send(_wire.Kind.INIT, {"dtype": str(params.dtype), "workers": workers},
                        params)
        self._expect(_wire.Kind.ACK)

    def stats(self) -> dict:
        self._conn.send(_wire.Kind.STATS)
        return self._expect(_wire.Kind.STATS).meta
