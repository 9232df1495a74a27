"""A connection to the parameter server: pull parameters, push updates, answer evaluation
requests; the driver also INITs the server, asks for evaluations and reads its counters."""

from __future__ import annotations

import numpy as np

from sparkdl_avg._eval_sums import eval_message
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.auth import Credential, authenticate_to_server
from sparkdl_avg.net.frames import connect
from sparkdl_avg.net.tls import client_context


class PSClient:
    def __init__(self, address: tuple[str, int], *, secret: bytes | Credential, worker: int,
                 numel: int, dtype: np.dtype, timeout: float, tls_ca_pem: str | None = None,
                 out: np.ndarray | None = None, attempt: int = 0) -> None:
        """`worker`: the worker id (-1: the driver). `secret`: the worker's own `Credential`,
        or the shared secret (its holder may take any id). `tls_ca_pem`: PEM text of a CA
        (or the server's self-signed certificate): speak TLS and verify the server with it. `out`:
        where pulls land (a shard's view of a larger buffer); None: an array of its own.
        `attempt`: the worker task's Spark task attempt id (`msg.ServerHello.attempt`)."""
        tls = client_context(tls_ca_pem) if tls_ca_pem else None
        self._conn = connect(address, timeout=timeout, max_payload=0, tls=tls)
        try:
            authenticate_to_server(self._conn, secret, msg.ServerHello(worker=worker,
                                                                    attempt=attempt))
        except BaseException:
            self._conn.close()
            raise
        self.params = np.empty(numel, dtype) if out is None else out
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
        msg.send(self._conn, msg.Pull())
        params, _ = msg.expect(self._conn, msg.Params,
                               into=msg.into_checked(self.params, "the parameter server"))
        self.progress = params.progress
        return params.version

    def pull_snapshot(self) -> int | None:
        """Fetch the parameters of the evaluation request this worker has yet to answer into
        `self.params`; returns its id (None: no request is pending any more, and `params`
        holds the current parameters)."""
        msg.send(self._conn, msg.Pull(evaluate=True))
        params, _ = msg.expect(self._conn, msg.Params,
                               into=msg.into_checked(self.params, "the parameter server"))
        return params.evaluate

    def answer(self, request: int, result: dict, eval_s: float) -> msg.Ack:
        """Send this worker's evaluation {loss_sum, loss_weight, correct, scored, count,
        metrics, tables} of `request` (`task.evaluate.evaluate_batches`), the metrics' score
        tables as payload (`_eval_sums.eval_message`)."""
        msg.send(self._conn, *eval_message(result, eval_s, request))
        return msg.expect(self._conn, msg.Ack)[0]

    def finished(self, wait_s: float) -> msg.Ack:
        """This worker has pushed its last update: wait (up to `wait_s`) for an evaluation
        request for it, or for leave to end (`Ack.done`)."""
        msg.send(self._conn, msg.Finished(wait_s=wait_s))
        return msg.expect(self._conn, msg.Ack)[0]

    def push(self, update: np.ndarray, *, samples: int = 0, loss_sum: float = 0.0,
             steps: int | None = None, lr: float | None = None) -> msg.Ack:
        """Send an update (the server applies w <- w - update by its rule). `steps`: the
        worker's local steps including this update (its progress); `lr`: the learning rate
        it was computed with (None: the server's)."""
        msg.send(self._conn, msg.Update(samples=samples, loss_sum=msg.finite_or_none(loss_sum),
                                        steps=steps, lr=lr, **msg.tensor(update)), update)
        return msg.expect(self._conn, msg.Ack)[0]

    def init(self, params: np.ndarray, workers: int = 0, expect: dict | None = None,
             gradients: int | None = None) -> dict:
        """Driver only: (re)start the server from these parameters, expecting workers
        0..workers-1 (they count for the staleness bound from now on). `expect`: settings
        the server must have (it refuses otherwise); `gradients`: the leading values a
        gradient moves (`ps.rules`; None: all). Returns the server's settings."""
        msg.send(self._conn, msg.Init(workers=workers, expect=expect or {},
                                      gradients=gradients, **msg.tensor(params)), params)
        return msg.expect(self._conn, msg.Settings)[0].settings

    def stop(self) -> dict:
        """Driver only: end training early (early stopping); returns the server's stats."""
        msg.send(self._conn, msg.Stop())
        return self._report()

    def stats(self) -> dict:
        msg.send(self._conn, msg.Stats())
        return self._report()

    def evaluate(self) -> dict:
        """Driver only: ask the workers to evaluate the current parameters. Returns the
        server's stats at that moment; evaluations.pending names the request (none once the
        final request is made)."""
        msg.send(self._conn, msg.Evaluate())
        return self._report()

    def _report(self) -> dict:
        """The server's STATS answer: its counters, and under "checkpoint_error" its first
        checkpoint save that failed (None while all succeed)."""
        answer = msg.expect(self._conn, msg.Stats)[0]
        return {**(answer.report or {}), "checkpoint_error": answer.checkpoint_error}
