"""The parameter server's handlers of a fit's start, evaluations and end, beside its pulls and
pushes: the driver's INIT and EVALUATE, a worker's PULL of a request's snapshot, its EVAL and
its FINISHED (`evaluations` keeps the books). A part of `server.ParameterServer`, kept apart
for size: they run on its handler threads, with its state, under its lock."""

from __future__ import annotations

import time

import numpy as np

from sparkdl_avg._errors import ProtocolError
from sparkdl_avg._eval_sums import received_part
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.frames import Connection

DRIVER = -1
"""The worker id the driver uses: it sends INIT and EVALUATE, pulls the final parameters,
and is no SSP member."""


class FitLifecycle:
    """Mixed into `ParameterServer`, whose state they read and write."""

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
        if not np.isfinite(params).all():
            self.refuse("non_finite", "INIT holds NaN or Inf: refused", DRIVER, conn)
            return
        with self._lock:
            self._fit += 1
            self._announce(init.workers)
            self.rule = self._new_rule(params, init.gradients)
            self.applied, self.samples, self.loss_sum = 0, 0, 0.0
            self.stopped = False
            self.lrs.clear()
            self.progress.clear()
            self._attempts.clear()  # a new fit: perhaps another application's attempt ids
            self._pulled_version.clear()
            self.staleness.clear()
            self.evaluations.reset(init.workers)
            if self._checkpoint is not None:  # a new fit: not failed by an earlier fit's save
                self._checkpoint.error = None
            self._save_checkpoint()
            self._lock.notify_all()  # requests waiting at a gate across it are refused
        msg.send(conn, msg.Settings(settings={**self.settings.to_dict(),
                                              **self.rule.settings()}))

    def _announce(self, workers: int) -> None:
        """With the lock held: a new set of clocks. Workers announced by the driver count for
        the staleness bound before they connect, so an early worker cannot run ahead of one
        still loading; with none announced, the connected ones count. A worker of an earlier
        fit that is not announced again is no member: it holds no one back."""
        self._announced = workers
        self.clocks.reset(range(workers) if workers else
                          [w for w in self._owners if w != DRIVER])

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

    def _answer(self, conn: Connection, worker: int, message: msg.Eval,
                payload: memoryview | None) -> None:
        if message.request is None:
            self.refuse("malformed", "an EVAL to the parameter server must name its request",
                        worker, conn)
            return
        try:  # the score tables checked: sorted, finite, of the rows `ranked` says
            part = received_part(message, payload)
        except ProtocolError as exc:
            self.refuse(exc.reason, exc, worker, conn)
            return
        with self._lock:
            done = self.evaluations.answer(worker, message.request, part)
            if done is not None and done["final"]:  # the workers end: keep it for the driver
                self._save_checkpoint()
            self._lock.notify_all()  # a finished worker may wait for the final one
            ack = msg.Ack(applied=self.applied, evaluate=self.evaluations.offer(worker))
        msg.send(conn, ack)

    def _finished(self, conn: Connection, worker: int, message: msg.Finished) -> None:
        """Hold the answer (up to `wait_s`) until there is a request for `worker` or it may
        end. Its clocks go: it will not push again, so it holds no one back (and a PULL or
        UPDATE on this connection is refused from now on)."""
        if self.rule is None:
            self.refuse("unexpected", "the server has no parameters yet (no INIT)", worker,
                        conn)
            return
        with self._lock:
            # taken over since it was read: the newer connection speaks for the worker now
            replaced = self._owners.get(worker) is not conn
            if not replaced:
                self.evaluations.finish(worker, self.rule.params, self.applied)
                self.clocks.leave(worker)
                self._lock.notify_all()
                ack = self._await_request(worker, min(message.wait_s, self.settings.timeout))
        if replaced:
            self.refuse("unexpected", "a newer connection took over this worker id", worker,
                        conn)
            return
        msg.send(conn, ack)

    def _await_request(self, worker: int, wait_s: float) -> msg.Ack:
        """With the lock held: wait up to `wait_s` for a request for a finished `worker`, or
        until it may end; the answer to its FINISHED."""
        evaluations = self.evaluations
        deadline = time.monotonic() + wait_s
        while evaluations.offer(worker) is None and not evaluations.done(worker):
            left = deadline - time.monotonic()
            if left <= 0 or self._closed.is_set():
                break
            self._lock.wait(timeout=min(left, 0.5))
        return msg.Ack(applied=self.applied, evaluate=evaluations.offer(worker),
                       done=evaluations.done(worker))

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
