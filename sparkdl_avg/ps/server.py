"""The asynchronous parameter server: pull parameters, push updates.

Each connected worker is served on its own thread (the `net.server.Server` base); the update
rule (`rules`) and the staleness gates (`staleness`) run under one lock. What a worker sends
is checked before it touches the parameters: a malformed message, an update of the wrong size
or with NaN/Inf is refused with an ERROR reply and counted by its reason code, and the server
stays up. `staleness_bound` holds a worker's pulls until it is at most that many pushes ahead
of the slowest connected worker, and holds a push until every other worker has read the
parameters of that many clocks back; with a bound of 0 the rounds are exactly synchronous.
A worker that has pushed its last update (FINISHED) holds no one back any more.

Evaluation (`evaluations`): the driver's EVALUATE keeps a copy of the parameters; the workers
evaluate it on their own rows and send their sums (EVAL), which the server adds up.
"""

from __future__ import annotations

import collections
import logging
import ssl
import time

import numpy as np

from sparkdl_avg._errors import PeerClosed, ProtocolError, Unacceptable
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.frames import Connection
from sparkdl_avg.net.server import MAX_PENDING, Server
from sparkdl_avg.ps import state_file
from sparkdl_avg.ps.evaluations import Evaluations
from sparkdl_avg.ps.rules import UpdateRule, make_rule
from sparkdl_avg.ps.settings import ServerSettings
from sparkdl_avg.ps.staleness import may_apply, may_read, summary

log = logging.getLogger("sparkdl_avg")
SECRET_ENV = "SPARKDL_AVG_PS_SECRET"
"""How a started server gets its secret (not the command line, which others can read)."""
DRIVER = -1
"""The worker id the driver uses: it sends INIT and EVALUATE, pulls the final parameters,
and is no SSP member."""


class ParameterServer(Server):
    """Owns the parameters and the workers' connections. `close()` stops all."""

    def __init__(self, settings: ServerSettings | None = None, *, secret: bytes,
                 host: str = "127.0.0.1", port: int = 0, tls: ssl.SSLContext | None = None,
                 checkpoint_path: str | None = None, rule: UpdateRule | None = None,
                 max_pending: int = MAX_PENDING) -> None:
        """`checkpoint_path`: save the state there at INIT and every
        `settings.checkpoint_every` applied updates, so a restarted server resumes from it.
        `rule`: start with these parameters instead of waiting for an INIT."""
        settings = settings or ServerSettings()
        super().__init__(secret=secret, host=host, port=port, tls=tls,
                         max_connections=settings.max_connections, max_pending=max_pending,
                         name="parameter server")
        self.settings = settings
        self.rule = rule
        """None until a driver sends INIT with the initial parameters."""
        self._clocks: dict[int, int] = {}
        self._read_clocks: dict[int, int] = {}
        self._pulled_version: dict[int, int] = {}
        self.applied = 0
        self.samples = 0
        self.loss_sum = 0.0
        self.staleness: dict[int, list[int]] = collections.defaultdict(list)
        self._owners: dict[int, Connection] = {}
        self._announced = 0
        """Workers the driver's INIT announced (they count before they connect)."""
        self.progress: dict[int, int] = {}
        """Per worker: the local steps its applied pushes cover (where a restarted one
        resumes)."""
        self.evaluations = Evaluations()
        self.lrs: dict[int, float] = {}
        """Per worker: the learning rate of its newest update (a schedule's); the stats
        report their mean."""
        self.stopped = False
        """Early stopping: the driver's STOP; every ACK to an UPDATE then says stop."""
        self._checkpoint = state_file.writer(checkpoint_path) if checkpoint_path else None

    def close(self) -> None:
        super().close()
        if self._checkpoint is not None:
            self._checkpoint.close()

    def _new_rule(self, params: np.ndarray) -> UpdateRule:
        s = self.settings
        return make_rule(s.algorithm, params, lr=s.lr, update_scale=s.update_scale,
                         dc_lambda=s.dc_lambda)

    def restore(self, path: str) -> None:
        """Take up a checkpoint written by a server with the same settings (before start)."""
        arrays, meta = state_file.load(path)
        self.rule = self._new_rule(arrays.pop("params"))
        self.rule.load_state(arrays)
        self.applied, self.samples, self.loss_sum = (meta["applied"], meta["samples"],
                                                     meta["loss_sum"])
        self.progress = {int(w): int(s) for w, s in meta["progress"].items()}
        self.stopped = bool(meta.get("stopped", False))
        self.refused.update(meta["refused"])
        self._announce(int(meta.get("workers", 0)))
        self.evaluations.reset(self._announced, results=meta.get("evaluations", []))
        log.info("resumed from %s: %d updates applied, progress %s", path, self.applied,
                 self.progress)

    def _save_checkpoint(self) -> None:
        """With the lock held: hand a copy of the state to the background writer."""
        if self._checkpoint is None or self.rule is None:
            return
        arrays = {"params": self.rule.params.copy(), **self.rule.state()}
        meta = {"applied": self.applied, "samples": self.samples, "loss_sum": self.loss_sum,
                "progress": {str(w): s for w, s in self.progress.items()},
                "refused": dict(self.refused), "workers": self._announced,
                "evaluations": list(self.evaluations.results), "stopped": self.stopped}
        self._checkpoint.submit((arrays, meta))

    def stats(self) -> dict:
        with self._lock:
            staleness = {str(w): summary(v) for w, v in self.staleness.items()}
            return {"applied": self.applied, "refused": dict(self.refused),
                    "clocks": {str(w): c for w, c in self._clocks.items()},
                    "progress": {str(w): s for w, s in self.progress.items()},
                    "samples": self.samples, "loss_sum": self.loss_sum,
                    "staleness": staleness, "evaluations": self.evaluations.report(),
                    "lr": float(np.mean(list(self.lrs.values()))) if self.lrs else None,
                    "stopped": self.stopped}

    def _report(self) -> msg.Stats:
        """STATS: the counters, and the first checkpoint save that failed. The server goes on
        serving (the next save may succeed); the driver decides: it fails the fit."""
        failed = self._checkpoint.failure if self._checkpoint is not None else None
        return msg.Stats(report=self.stats(), checkpoint_error=failed and
                         failed[:msg.MAX_ERROR_CHARS])

    def serve(self, conn: Connection, hello: dict) -> bool:
        try:
            worker = msg.ServerHello.from_meta(hello).worker
        except ProtocolError as exc:
            self.refuse(exc.reason, exc, hello, conn)
            return False
        conn.max_payload = self.settings.max_message_mb << 20 if worker == DRIVER else 0
        conn.set_timeout(self.settings.timeout)
        with self._lock:
            if self._announced and worker >= self._announced:
                unknown = f"worker id {worker} is not one of the {self._announced} announced"
            else:
                unknown = None
                # One live connection per id: a reconnecting worker replaces its stale one.
                stale = self._owners.get(worker)
                if stale is not None:
                    stale.close()
                self._owners[worker] = conn
                if worker != DRIVER:  # the driver pulls and inits but holds no one back
                    start = min(self._clocks.values(), default=0)
                    self._clocks.setdefault(worker, start)
                    self._read_clocks.setdefault(worker, start - 1)  # has read nothing yet
        if unknown:
            self.refuse("unexpected", unknown, worker, conn)
            return False
        try:
            self._serve_worker(conn, worker)
        finally:
            with self._lock:  # a gone worker no longer holds the others back
                if self._owners.get(worker) is conn:
                    del self._owners[worker]
                    self._clocks.pop(worker, None)
                    self._read_clocks.pop(worker, None)
                self._lock.notify_all()
        return False

    def _serve_worker(self, conn: Connection, worker: int) -> None:
        update = np.empty(0)  # this connection's receive buffer, sized to the model

        def into(message: msg.Message) -> np.ndarray | None:
            nonlocal update
            if not isinstance(message, msg.Update):
                return None  # INIT (driver only) goes to a fresh buffer within max_payload
            if self.rule is None:
                raise ProtocolError("the server has no parameters yet (no INIT)", "unexpected")
            msg.check_tensor(message, self.rule.params, f"worker {worker}")
            if update.shape != self.rule.params.shape:
                update = np.empty_like(self.rule.params)
            return update

        while not self._closed.is_set():
            try:
                message, payload = msg.receive(conn, into)
            except PeerClosed:
                return
            except Unacceptable as exc:  # the frame was read whole: answer, go on
                self.refuse(exc.reason, exc, worker, conn)
                continue
            except ProtocolError as exc:
                # Refused; the stream may be out of step, so this connection ends here.
                self.refuse(exc.reason, exc, worker, conn)
                return
            except OSError:  # timed out or reset
                return
            if self._owners.get(worker) is not conn:  # replaced by a newer connection
                self.refuse("unexpected", "a newer connection took over this worker id",
                            worker, conn)
                return
            if isinstance(message, msg.Pull):
                if not self._pull(conn, worker, message.evaluate):
                    return
            elif isinstance(message, msg.Update):
                if not self._apply(conn, worker, update, message):
                    return
            elif isinstance(message, msg.Eval) and worker != DRIVER:
                self._answer(conn, worker, message)
            elif isinstance(message, msg.Finished) and worker != DRIVER:
                self._finished(conn, worker, message)
            elif isinstance(message, msg.Evaluate) and worker == DRIVER:
                self._evaluate(conn)
            elif isinstance(message, msg.Stop) and worker == DRIVER:
                with self._lock:
                    self.stopped = True
                    self._save_checkpoint()
                msg.send(conn, self._report())
            elif isinstance(message, msg.Init) and worker == DRIVER:
                self._init(conn, message, payload)
            elif isinstance(message, msg.Stats) and message.report is None:
                msg.send(conn, self._report())
            else:
                self.refuse("unexpected", f"unexpected {message.KIND.name}", worker, conn)

    def _pull(self, conn: Connection, worker: int, evaluate: bool = False) -> bool:
        if self.rule is None:
            self.refuse("unexpected", "the server has no parameters yet (no INIT)", worker,
                        conn)
            return True
        if evaluate:
            return self._pull_snapshot(conn, worker)
        with self._lock:
            if worker != DRIVER and not self._wait_for(
                    lambda: may_read(self._clocks, worker, self.settings.staleness_bound)):
                self.refuse("timeout", "timed out waiting for slower workers", worker, conn)
                return False
            params = self.rule.pull(worker).copy()
            version = self._pulled_version[worker] = self.applied
            progress = self.progress.get(worker, 0)
            if worker != DRIVER and worker in self._clocks:
                self._read_clocks[worker] = self._clocks[worker]
                self._lock.notify_all()
        msg.send(conn, msg.Params(version=version, progress=progress, **msg.tensor(params)),
                 params)
        return True

    def _apply(self, conn: Connection, worker: int, update: np.ndarray,
               message: msg.Update) -> bool:
        if not np.isfinite(update).all():
            self.refuse("non_finite", "update holds NaN or Inf: refused", worker, conn)
            return True
        if self.stopped:  # computed before the worker heard: the fit ended at the stop
            msg.send(conn, msg.Ack(applied=self.applied, stop=True))
            return True
        with self._lock:
            clock = self._clocks.get(worker, 0)
            if not self._wait_for(lambda: may_apply(self._read_clocks, worker, clock,
                                                    self.settings.staleness_bound)):
                self.refuse("timeout", "timed out waiting for slower workers", worker, conn)
                return False
            try:
                self.rule.apply(worker, update, lr=message.lr)
            except ValueError as exc:
                self.refuse("malformed", exc, worker, conn)
                return True
            staleness = self.applied - self._pulled_version.get(worker, 0)
            self.applied += 1
            self.staleness[worker].append(staleness)
            self._clocks[worker] = clock + 1
            self._lock.notify_all()
            applied = self.applied
            if message.lr is not None:
                self.lrs[worker] = message.lr
            if message.loss_sum is not None:
                self.samples += message.samples
                self.loss_sum += message.loss_sum
            if message.steps is not None:
                self.progress[worker] = message.steps
            every = self.settings.checkpoint_every
            if every and applied % every == 0:
                self._save_checkpoint()
            offer = self.evaluations.offer(worker)
        msg.send(conn, msg.Ack(applied=applied, staleness=staleness, evaluate=offer,
                               stop=self.stopped))
        return True

    def _pull_snapshot(self, conn: Connection, worker: int) -> bool:
        """The parameters of the request `worker` has yet to answer; if none is pending any
        more (replaced), the current ones, marked as no request's. No read for the SSP
        gates, no DC-ASGD backup, no change to the worker's staleness."""
        with self._lock:
            request = self.evaluations.snapshot(worker)
            if request is None:
                params, version, number = self.rule.params.copy(), self.applied, None
            else:  # never written after it is taken: sent as it is
                params, version, number = request.params, request.applied, request.request
            progress = self.progress.get(worker, 0)
        msg.send(conn, msg.Params(version=version, progress=progress, evaluate=number,
                                  **msg.tensor(params)), params)
        return True

    def _answer(self, conn: Connection, worker: int, message: msg.Eval) -> None:
        if message.request is None:
            self.refuse("malformed", "an EVAL to the parameter server must name its request",
                        worker, conn)
            return
        with self._lock:
            done = self.evaluations.answer(worker, message.request, {
                "loss_sum": message.loss_sum, "loss_weight": message.loss_weight,
                "correct": message.correct, "scored": message.scored, "count": message.count,
                "eval_s": message.eval_s})
            if done is not None and done["final"]:  # the workers end: keep it for the driver
                self._save_checkpoint()
            self._lock.notify_all()  # a finished worker may wait for the final one
            ack = msg.Ack(applied=self.applied, evaluate=self.evaluations.offer(worker))
        msg.send(conn, ack)

    def _finished(self, conn: Connection, worker: int, message: msg.Finished) -> None:
        """Hold the answer (up to `wait_s`) until there is a request for `worker` or it may
        end. Its clocks go: it will not push again, so it holds no one back."""
        if self.rule is None:
            self.refuse("unexpected", "the server has no parameters yet (no INIT)", worker,
                        conn)
            return
        evaluations = self.evaluations
        with self._lock:
            evaluations.finish(worker, self.rule.params, self.applied)
            self._clocks.pop(worker, None)
            self._read_clocks.pop(worker, None)
            self._lock.notify_all()
            deadline = time.monotonic() + min(message.wait_s, self.settings.timeout)
            while evaluations.offer(worker) is None and not evaluations.done(worker):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set():
                    break
                self._lock.wait(timeout=min(left, 0.5))
            ack = msg.Ack(applied=self.applied, evaluate=evaluations.offer(worker),
                          done=evaluations.done(worker))
        msg.send(conn, ack)

    def _evaluate(self, conn: Connection) -> None:
        """The driver's EVALUATE: a request of the current parameters (none once the final
        one is made), answered with the stats of that same moment."""
        if self.rule is None:
            self.refuse("unexpected", "the server has no parameters yet (no INIT)", DRIVER,
                        conn)
            return
        with self._lock:
            self.evaluations.ask(self.rule.params, self.applied)
            self._lock.notify_all()  # finished workers wait for requests
            report = self._report()
        msg.send(conn, report)

    def _wait_for(self, condition) -> bool:
        """With the lock held: wait (bounded) until `condition()` or no bound is set."""
        if self.settings.staleness_bound is None:
            return True
        deadline = time.monotonic() + self.settings.timeout
        while not condition():
            if self._closed.is_set() or time.monotonic() > deadline:
                return False
            self._lock.wait(timeout=0.5)
        return True

    def _init(self, conn: Connection, init: msg.Init, payload: memoryview) -> None:
        differences = self.settings.differences(init.expect)
        if differences:
            self.refuse("settings", "the fit and this server disagree: "
                        + "; ".join(differences), DRIVER, conn)
            return
        if payload.nbytes != init.numel * np.dtype(init.dtype).itemsize:
            self.refuse("shape", f"INIT of {payload.nbytes} bytes is no array of {init.numel} "
                        f"{init.dtype} values", DRIVER, conn)
            return
        params = np.frombuffer(payload, dtype=init.dtype).copy()
        with self._lock:
            self._announce(init.workers)
            self.rule = self._new_rule(params)
            self.applied, self.samples, self.loss_sum = 0, 0, 0.0
            self.stopped = False
            self.lrs.clear()
            self.progress.clear()
            self._pulled_version.clear()
            self.staleness.clear()
            self.evaluations.reset(init.workers)
            if self._checkpoint is not None:  # a new fit: not failed by an earlier fit's save
                self._checkpoint.error = None
            self._save_checkpoint()
        msg.send(conn, msg.Settings(settings={**self.settings.to_dict(),
                                              **self.rule.settings()}))

    def _announce(self, workers: int) -> None:
        """With the lock held: workers announced by the driver count for the staleness bound
        before they connect, so an early worker cannot run ahead of one still loading."""
        self._announced = workers
        for w in range(workers):
            self._clocks.setdefault(w, 0)
            self._read_clocks.setdefault(w, -1)  # no push applies before its first read
