"""Async mode in a task (Downpour): push the accumulated update every `push_every` steps,
fetch the server's parameters every `fetch_every` steps (a multiple of push_every), and with
a staleness bound s at least every s + 1 pushes (`staleness.pushes_between_fetches`: fetching
more rarely, the workers would wait on each other for good).

The server records how many of this worker's steps it has applied; a worker (re)starting or
reconnecting after the server restarted takes up the data from there, so no step is lost or
counted twice.

With evaluation rows (eval_df), the worker also evaluates the server's parameters when the
driver asks: a request is announced in the answer to a push, and the worker evaluates the
copy of the parameters the server kept for it on its own evaluation rows, then goes on from
its own parameters. After its last push it stays, answering requests, until it has answered
the final one (the final parameters, once every worker has finished)."""

from __future__ import annotations

import time

import numpy as np

from sparkdl_avg._config import TrainConfig
from sparkdl_avg._errors import peer_gone
from sparkdl_avg.data.partition import Partition
from sparkdl_avg.net.auth import Credential
from sparkdl_avg.net.dial import pause_s, retryable
from sparkdl_avg.ps.client import PSClient
from sparkdl_avg.ps.sharded_client import ShardedClient, connect
from sparkdl_avg.ps.staleness import pushes_between_fetches
from sparkdl_avg.task.spec import WorkerSpec

FINISHED_WAIT_S = 2.0
"""How long the server may hold a finished worker's wait before it asks again."""


class ServerLost(ConnectionError):
    """The connection to the server broke (not a refusal): reconnect and take up the data
    where the server says. Raised only around the link's own calls to the server, so that an
    OSError of the worker's own (reading its data) is not mistaken for one."""


def train_async(spec: WorkerSpec, config: TrainConfig, rank: int, data: Partition,
                device, credential: Credential, attempt: int = 0) -> dict:
    """Train to the end; returns `Replica.outcome()` for the task's report. `attempt`: this
    task's Spark task attempt id; the server serves the latest attempt of a worker id only, so
    an earlier attempt still running (Spark ran the task again) is refused ("ended")."""
    from sparkdl_avg.averaging.flat_buffer import FlatBuffer, averaged_tensors
    from sparkdl_avg.task.device import final_on_device_errors
    from sparkdl_avg.task.replica import Replica

    total = spec.schedule.total_steps
    with final_on_device_errors("build its replica on", str(device)):  # as the sync loop
        replica = Replica(spec, config, rank, data, device)
        flat = FlatBuffer(averaged_tensors(replica.model), replica.wire_dtype)
    link = ServerLink(spec, config, rank, flat, credential, attempt)
    evaluates = sum(spec.eval_rows) > 0  # every worker answers, with rows or without
    try:
        link.pull()
        replica.start(step=link.ps.progress)
        if evaluates and link.ps.progress == 0 and config.evaluates_first(True):
            link.answer(replica)  # round 0: the driver asked before any worker started
        fetch_every = pushes_between_fetches(config.push_every, config.fetch_every,
                                             config.staleness_bound)
        while True:
            try:
                while replica.step < total and not link.stopped:
                    loss_sum, samples, lr = replica.run_steps(
                        min(config.push_every, total - replica.step))
                    request = link.push(loss_sum, samples, replica.step, lr)
                    if link.pushes_since_pull >= fetch_every or replica.step >= total:
                        link.pull()
                    if request is not None:
                        link.answer(replica)
                if evaluates:
                    link.finish(replica)
                return replica.outcome()
            except ServerLost as exc:
                link.reconnect(exc)
                link.pull()
                replica.rewind(link.ps.progress)  # redo the steps the server lost
    finally:
        try:
            link.close()
        finally:
            replica.close()


class ServerLink:
    """A worker's connection to the parameter server that outlives the server: when the
    connection breaks (`ServerLost`) it reconnects (for up to `reconnect_timeout`) to the
    same address, where a restarted server takes up its checkpoint."""

    def __init__(self, spec: WorkerSpec, config: TrainConfig, rank: int, flat,
                 credential: Credential, attempt: int = 0) -> None:
        """`credential`: this task's own, claimed by enrolment (`task.enrolment`)."""
        self.spec, self.rank, self.flat, self.credential = spec, rank, flat, credential
        self.attempt = attempt
        self.waits = config.waits()
        self.anchor = flat.array.copy()  # the parameters the next update is measured from
        self._own: np.ndarray | None = None  # the model's parameters while it evaluates others
        self.pushes_since_pull = 0
        self.stopped = False
        """The server said stop (early stopping): push no more, as if at the last step."""
        self.ps = None
        self.reconnect(None, self.waits.connect)  # a server being restarted may not be back

    def _connect(self) -> PSClient | ShardedClient:
        return connect(self.spec.ps_addresses(), secret=self.credential,
                       worker=self.rank, numel=self.flat.array.size, dtype=self.flat.array.dtype,
                       timeout=self.waits.reply, tls_ca_pem=self.spec.tls_ca_pem,
                       attempt=self.attempt)

    def _call(self, fn, *args, **kwargs):
        """A call to the server; a lost connection raises `ServerLost`, a refusal or a
        protocol violation stays what it is (a restart would only repeat it)."""
        try:
            return fn(*args, **kwargs)
        except OSError as exc:
            if peer_gone(exc):
                raise ServerLost(str(exc)) from exc
            raise

    def pull(self) -> None:
        """The server's parameters into the model (and `ps.progress`)."""
        self._call(self.ps.pull)
        np.copyto(self.flat.array, self.ps.params)
        self.flat.scatter()
        np.copyto(self.anchor, self.flat.array)
        self.pushes_since_pull = 0

    def push(self, loss_sum: float, samples: int, steps: int, lr: float) -> int | None:
        """The update since the anchor (computed at mean learning rate `lr`), which moves to
        the current parameters. Returns an evaluation request the server has for this
        worker, if any; `stopped` says whether the driver ended training."""
        current = self.flat.gather()
        ack = self._call(self.ps.push, self.anchor - current, samples=samples,
                         loss_sum=loss_sum, steps=steps, lr=lr)
        np.copyto(self.anchor, current)
        self.pushes_since_pull += 1
        self.stopped = ack.stop
        return ack.evaluate

    def answer(self, replica) -> None:
        """Answer the evaluation requests the server has for this worker: each one's
        parameters into the model, evaluated on this worker's evaluation rows, and the
        model's own parameters put back, so the anchor and the next update are untouched."""
        while True:
            request = self._call(self.ps.pull_snapshot)
            if request is None:  # replaced meanwhile by none: nothing to answer
                return
            own = self.flat.gather()
            if self._own is None:
                self._own = np.empty_like(own)
            np.copyto(self._own, own)
            np.copyto(self.flat.array, self.ps.params)
            self.flat.scatter()
            started = time.perf_counter()
            try:
                result = replica.evaluate()
            finally:
                np.copyto(self.flat.array, self._own)
                self.flat.scatter()
            ack = self._call(self.ps.answer, request, result, time.perf_counter() - started)
            if ack.evaluate is None:
                return

    def finish(self, replica) -> None:
        """After the last push: answer requests until the final one is answered. Ends
        without it after `reply_timeout` seconds in which the server applied no update and
        asked nothing (a peer gone for good); the driver then reports it missing."""
        wait_s = min(FINISHED_WAIT_S, self.waits.reply / 2)
        applied, quiet_since = None, time.monotonic()
        while True:
            ack = self._call(self.ps.finished, wait_s)
            if ack.done:
                return
            if ack.evaluate is not None:
                self.answer(replica)
            elif ack.applied == applied:
                if time.monotonic() - quiet_since > self.waits.reply:
                    return
                continue
            applied, quiet_since = ack.applied, time.monotonic()

    def reconnect(self, cause: BaseException | None, limit: float | None = None) -> None:
        """Connect, retrying while the server is away (for `limit`: reconnect_timeout)."""
        limit = self.waits.reconnect if limit is None else limit
        name = "reconnect_timeout" if cause else "connect_timeout"
        deadline = time.monotonic() + limit
        if self.ps is not None:
            self.ps.close()
        attempt = 0
        while True:  # retried by `net.dial`'s rules: a busy server, or one restarting
            try:
                self.ps = self._connect()
                return
            except OSError as exc:
                if not retryable(exc) or time.monotonic() > deadline:
                    lost = f"lost the parameter server ({cause}) and " if cause else ""
                    raise ConnectionError(f"{lost}could not connect to it within "
                                          f"{name}={limit:g}s: {exc}") from exc
                time.sleep(min(0.5, pause_s(attempt)))
                attempt += 1

    def close(self) -> None:
        if self.ps is not None:
            self.ps.close()
