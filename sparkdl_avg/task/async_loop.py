"""Async mode in a task (Downpour): push the accumulated update every `push_every` steps,
fetch the server's parameters every `fetch_every` steps (a multiple of push_every).

The server records how many of this worker's steps it has applied; a worker (re)starting or
reconnecting after the server restarted takes up the data from there, so no step is lost or
counted twice."""

from __future__ import annotations

import time

import numpy as np

from sparkdl_avg._config import TrainConfig
from sparkdl_avg._errors import peer_gone
from sparkdl_avg.data.partition import Partition
from sparkdl_avg.ps.client import PSClient
from sparkdl_avg.task.spec import WorkerSpec


def train_async(spec: WorkerSpec, config: TrainConfig, rank: int, data: Partition,
                device) -> None:
    from sparkdl_avg.averaging.flat_buffer import FlatBuffer, averaged_tensors
    from sparkdl_avg.task.replica import Replica

    total = spec.schedule.total_steps
    replica = Replica(spec, config, rank, data, device)
    flat = FlatBuffer(averaged_tensors(replica.model), replica.wire_dtype)
    link = ServerLink(spec, config, rank, flat)
    try:
        link.pull()
        replica.start(step=link.ps.progress)
        fetch_every = (config.fetch_every or config.push_every) // config.push_every
        pushes = 0
        while replica.step < total:
            loss_sum, samples = replica.run_steps(min(config.push_every, total - replica.step))
            try:
                current = flat.gather()
                link.ps.push(link.anchor - current, samples=samples, loss_sum=loss_sum,
                             steps=replica.step)
                np.copyto(link.anchor, current)
                pushes += 1
                if pushes % fetch_every == 0 or replica.step >= total:
                    link.pull()
            except OSError as exc:  # ProtocolError is one too: only a lost server may retry
                if not peer_gone(exc):
                    raise
                link.reconnect(exc)
                link.pull()
                replica.rewind(link.ps.progress)  # redo the steps the server lost
    finally:
        link.close()


class ServerLink:
    """A worker's connection to the parameter server that outlives the server: when the
    connection breaks it reconnects (for up to `reconnect_timeout`) to the same address,
    where a restarted server takes up its checkpoint."""

    def __init__(self, spec: WorkerSpec, config: TrainConfig, rank: int, flat) -> None:
        self.spec, self.rank, self.flat = spec, rank, flat
        self.waits = config.waits()
        self.anchor = flat.array.copy()  # the parameters the next update is measured from
        self.ps = None
        self.reconnect(None, self.waits.connect)  # a server being restarted may not be back

    def _connect(self) -> PSClient:
        return PSClient(self.spec.address, secret=self.spec.secret, worker=self.rank,
                        numel=self.flat.array.size, dtype=self.flat.array.dtype,
                        timeout=self.waits.reply, tls_ca_pem=self.spec.tls_ca_pem)

    def pull(self) -> None:
        """The server's parameters into the model (and `ps.progress`)."""
        self.ps.pull()
        np.copyto(self.flat.array, self.ps.params)
        self.flat.scatter()
        np.copyto(self.anchor, self.flat.array)

    def reconnect(self, cause: BaseException | None, limit: float | None = None) -> None:
        """Connect, retrying while the server is away (for `limit`: reconnect_timeout)."""
        limit = self.waits.reconnect if limit is None else limit
        name = "reconnect_timeout" if cause else "connect_timeout"
        deadline = time.monotonic() + limit
        if self.ps is not None:
            self.ps.close()
        while True:
            try:
                self.ps = self._connect()
                return
            except OSError as exc:
                if not peer_gone(exc) or time.monotonic() > deadline:
                    lost = f"lost the parameter server ({cause}) and " if cause else ""
                    raise ConnectionError(f"{lost}could not connect to it within "
                                          f"{name}={limit:g}s: {exc}") from exc
                time.sleep(0.5)

    def close(self) -> None:
        if self.ps is not None:
            self.ps.close()
