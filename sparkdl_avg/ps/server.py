"""The asynchronous parameter server: pull parameters, push updates.

Each connected worker is served on its own thread (the `net.server.Server` base); the update
rule (`rules`) and the staleness gates (`staleness`) run under one lock. What a worker sends
is checked before it touches the parameters: a malformed message, an update of the wrong size
or with NaN/Inf, or one whose *result* would not be finite (an INIT of NaN, overflowing
updates, DC-ASGD with a tiny lr, totals out of range) is refused with an ERROR reply counted by
its reason code, nothing changes, and the server stays up. `staleness_bound` holds a worker's
pulls until it is at most that many pushes ahead of the slowest member, and holds a push until
every other member has read the parameters of that many clocks back; with a bound of 0 the
rounds are exactly synchronous. A worker past its last update (FINISHED) is no member any
more (refused); a new INIT makes a new set of members.

One live connection per worker id: a newer one takes over at once (a restarted task must not
wait out a dead one's timeout). Only its own handler closes the older one, after the request
in hand (`Connection.end_reads`); what it had not applied yet is refused, not applied.

Evaluation (`evaluations`): the driver's EVALUATE keeps a copy of the parameters; the workers
evaluate it on their own rows and send their sums (EVAL), which the server adds up.
"""

from __future__ import annotations

import collections
import logging
import math
import ssl
import time

import numpy as np

from sparkdl_avg._errors import PeerClosed, ProtocolError, Unacceptable
from sparkdl_avg._eval_sums import payload_target
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.fields import MAX_NUMBER
from sparkdl_avg.net.frames import Connection
from sparkdl_avg.net.server import MAX_PENDING, Server
from sparkdl_avg.ps import state_file
from sparkdl_avg.ps.evaluations import Evaluations
from sparkdl_avg.ps.lifecycle import DRIVER, FitLifecycle
from sparkdl_avg.ps.rules import UpdateRule, make_rule
from sparkdl_avg.ps.settings import ServerSettings
from sparkdl_avg.ps.staleness import Clocks, summary

log = logging.getLogger("sparkdl_avg")
SECRET_ENV = "SPARKDL_AVG_PS_SECRET"
"""How a started server gets its secret (not the command line, which others can read)."""
__all__ = ["DRIVER", "SECRET_ENV", "ParameterServer"]


class ParameterServer(FitLifecycle, Server):
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
        self.clocks = Clocks()
        self._fit = 0
        """Counts INITs: a request that waited across one is refused, not applied."""
        self._pulled_version: dict[int, int] = {}
        self.applied = 0
        self.samples = 0
        self.loss_sum = 0.0
        self.staleness: dict[int, collections.Counter] = collections.defaultdict(
            collections.Counter)
        self._owners: dict[int, Connection] = {}
        self._attempts: dict[int, int] = {}
        """Per worker id: the latest task attempt that connected (`ServerHello.attempt`)."""
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

    def _new_rule(self, params: np.ndarray, gradients: int | None) -> UpdateRule:
        s = self.settings
        return make_rule(s.algorithm, params, lr=s.lr, update_scale=s.update_scale,
                         dc_lambda=s.dc_lambda, gradients=gradients)

    def restore(self, path: str) -> None:
        """Take up a checkpoint written by a server with the same settings (before start)."""
        arrays, meta = state_file.load(path)
        self.rule = self._new_rule(arrays.pop("params"), meta.get("gradients"))
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
                "evaluations": list(self.evaluations.results), "stopped": self.stopped,
                "gradients": self.rule.gradients}  # a restored rule needs it
        self._checkpoint.submit((arrays, meta))

    def stats(self) -> dict:
        with self._lock:
            staleness = {str(w): summary(v) for w, v in self.staleness.items()}
            return {"applied": self.applied, "refused": dict(self.refused),
                    "clocks": {str(w): c for w, c in self.clocks.pushed.items()},
                    "progress": {str(w): s for w, s in self.progress.items()},
                    "samples": self.samples, "loss_sum": self.loss_sum,
                    "staleness": staleness, "evaluations": self.evaluations.report(),
                    "lr": _mean(self.lrs.values()) if self.lrs else None,
                    "stopped": self.stopped}

    def _report(self) -> msg.Stats:
        """STATS: the counters, and the first checkpoint save that failed. The server goes on
        serving (the next save may succeed); the driver decides: it fails the fit."""
        failed = self._checkpoint.failure if self._checkpoint is not None else None
        return msg.Stats(report=self.stats(), checkpoint_error=failed and
                         failed[:msg.MAX_ERROR_CHARS])

    def serve(self, conn: Connection, hello: dict) -> bool:
        try:
            introduced = msg.ServerHello.from_meta(hello)
        except ProtocolError as exc:
            self.refuse(exc.reason, exc, hello, conn)
            return False
        worker, attempt = introduced.worker, introduced.attempt
        conn.max_payload = self.settings.max_message_mb << 20 if worker == DRIVER else 0
        conn.set_timeout(self.settings.timeout)
        with self._lock:
            latest = self._attempts.get(worker, attempt)
            if self._announced and worker >= self._announced:
                refusal = ("unexpected", f"worker id {worker} is not one of the "
                           f"{self._announced} announced")
            elif attempt < latest:  # Spark runs this task again: that attempt trains
                refusal = ("ended", f"attempt {attempt} of worker {worker} ended: attempt "
                           f"{latest} holds its place")
            else:
                refusal = None
                self._attempts[worker] = attempt
                # One live connection per id: a reconnecting worker replaces its stale one.
                stale = self._owners.get(worker)
                if stale is not None:
                    stale.end_reads()
                    self._lock.notify_all()  # its requests waiting at a gate are refused
                self._owners[worker] = conn
                if worker != DRIVER:  # the driver pulls and inits but holds no one back
                    self.clocks.join(worker)
        if refusal:
            self.refuse(*refusal, worker, conn)
            return False
        try:
            self._serve_worker(conn, worker, attempt)
        finally:
            with self._lock:  # a gone worker no longer holds the others back
                if self._owners.get(worker) is conn:
                    del self._owners[worker]
                    self.clocks.leave(worker)
                self._lock.notify_all()
        return False

    def _serve_worker(self, conn: Connection, worker: int, attempt: int) -> None:
        update = np.empty(0)  # this connection's receive buffer, sized to the model

        def into(message: msg.Message) -> np.ndarray | None:
            nonlocal update
            if isinstance(message, msg.Eval):  # the metrics' score tables, of a checked size
                return payload_target(message)
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
                with conn.within(conn.timeout):  # the whole message in one wait: no trickle
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
                later = self._attempts.get(worker, attempt) > attempt
                self.refuse("ended" if later else "unexpected",
                            "a later attempt of this worker's task took its place" if later
                            else "a newer connection took over this worker id", worker, conn)
                return
            try:
                if not self._dispatch(conn, worker, message, payload, update):
                    return
            except OSError:  # the peer went while we answered
                return

    def _dispatch(self, conn: Connection, worker: int, message: msg.Message,
                  payload: memoryview | None, update: np.ndarray) -> bool:
        """Answer one request; False ends the connection."""
        if isinstance(message, msg.Pull):
            return self._pull(conn, worker, message.evaluate)
        if isinstance(message, msg.Update) and worker != DRIVER:  # the driver has no clock
            return self._apply(conn, worker, update, message)
        if isinstance(message, msg.Eval) and worker != DRIVER:
            self._answer(conn, worker, message, payload)
        elif isinstance(message, msg.Finished) and worker != DRIVER:
            self._finished(conn, worker, message)
        elif isinstance(message, msg.Evaluate) and worker == DRIVER:
            self._evaluate(conn)
        elif isinstance(message, msg.Stop) and worker == DRIVER:
            with self._lock:
                self.stopped = True
                self._save_checkpoint()
                self._lock.notify_all()  # a push waiting at a gate is answered: stopped
            msg.send(conn, self._report())
        elif isinstance(message, msg.Init) and worker == DRIVER:
            self._init(conn, message, payload)
        elif isinstance(message, msg.Stats) and message.report is None:
            msg.send(conn, self._report())
        else:
            self.refuse("unexpected", f"unexpected {message.KIND.name}", worker, conn)
        return True

    def _pull(self, conn: Connection, worker: int, evaluate: bool = False) -> bool:
        if self.rule is None:
            self.refuse("unexpected", "the server has no parameters yet (no INIT)", worker,
                        conn)
            return True
        if evaluate:
            return self._pull_snapshot(conn, worker)
        with self._lock:
            why = self._gate(worker, conn, self.clocks.may_read)
            if why is None:
                params = self.rule.pull(worker).copy()
                version = self._pulled_version[worker] = self.applied
                progress = self.progress.get(worker, 0)
                if worker != DRIVER:
                    self.clocks.has_read(worker)
                    self._lock.notify_all()
        if why is not None:
            return self._refuse_gated(why, worker, conn)
        msg.send(conn, msg.Params(version=version, progress=progress, **msg.tensor(params)),
                 params)
        return True

    def _apply(self, conn: Connection, worker: int, update: np.ndarray,
               message: msg.Update) -> bool:
        if self.stopped:  # computed before the worker heard: the fit ended at the stop
            msg.send(conn, msg.Ack(applied=self.applied, stop=True))
            return True
        with self._lock:
            why = self._gate(worker, conn, self.clocks.may_apply) or self._totals_stay(message)
            stopped = why is None and self.stopped  # the stop came while it waited
            if why is None and not stopped:
                try:
                    # NaN/Inf in the update always reach the result the rule checks
                    if not self.rule.apply(worker, update, lr=message.lr):
                        why = ("non_finite", "the update holds NaN or Inf, or would leave "
                               "the parameters NaN or Inf (too large, or lr too small): "
                               "refused, nothing changed")
                except ValueError as exc:
                    why = ("malformed", exc)
            if why is None and not stopped:
                applied, staleness = self._count(worker, message)
                offer = self.evaluations.offer(worker)
        if why is not None:
            return self._refuse_gated(why, worker, conn)
        if stopped:  # not applied: the stop's checkpoint holds the fit's end
            msg.send(conn, msg.Ack(applied=self.applied, stop=True))
            return True
        msg.send(conn, msg.Ack(applied=applied, staleness=staleness, evaluate=offer,
                               stop=self.stopped))
        return True

    def _gate(self, worker: int, conn: Connection, gate) -> tuple[str, str] | None:
        """With the lock held: wait (bounded) until `gate(worker, bound)` lets a worker's
        request pass. Returns why it may not (reason, message), or None; the driver passes."""
        fit = self._fit
        if worker == DRIVER:
            return None
        why = self._no_member(worker, conn, fit)
        bound = self.settings.staleness_bound
        if why is None and not self._wait_for(lambda: self._no_member(worker, conn, fit)
                                              or self.stopped or gate(worker, bound)):
            return "timeout", "timed out waiting for slower workers"
        return why or self._no_member(worker, conn, fit)

    def _no_member(self, worker: int, conn: Connection, fit: int) -> tuple[str, str] | None:
        """With the lock held: why `conn` may not pull or push for `worker` now."""
        if self._owners.get(worker) is not conn:
            return "unexpected", "a newer connection took over this worker id"
        if fit != self._fit:
            return "unexpected", "the driver re-initialised the server meanwhile"
        if worker not in self.clocks.pushed:
            return "unexpected", (f"worker {worker} has finished or is not announced: it "
                                  "may not pull or push")
        return None

    def _refuse_gated(self, why: tuple[str, object], worker: int, conn: Connection) -> bool:
        """Refuse; a timed-out gate also ends the connection."""
        self.refuse(*why, worker, conn)
        return why[0] != "timeout"

    def _totals_stay(self, message: msg.Update) -> tuple[str, str] | None:
        """With the lock held: refuse an update that would take the totals out of range."""
        if message.loss_sum is None:
            return None
        if self.samples + message.samples > MAX_NUMBER:
            return "oversized", f"the samples in all would pass {MAX_NUMBER}"
        if not math.isfinite(self.loss_sum + message.loss_sum):
            return "non_finite", "the loss summed over all updates would not be finite"
        return None

    def _count(self, worker: int, message: msg.Update) -> tuple[int, int]:
        """With the lock held: an applied update's counters; (applied, its staleness)."""
        staleness = self.applied - self._pulled_version.get(worker, 0)
        self.applied += 1
        self.staleness[worker][staleness] += 1
        self.clocks.has_pushed(worker)
        self._lock.notify_all()
        if message.lr is not None:
            self.lrs[worker] = message.lr
        if message.loss_sum is not None:
            self.samples += message.samples
            self.loss_sum += message.loss_sum
        if message.steps is not None:
            self.progress[worker] = message.steps
        every = self.settings.checkpoint_every
        if every and self.applied % every == 0:
            self._save_checkpoint()
        return self.applied, staleness

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


def _mean(values) -> float:
    """A mean that cannot overflow (each lr is finite, their sum may not be)."""
    values = list(values)
    return float(sum(v / len(values) for v in values))

