"""The driver's side of synchronous averaging: a TCP server the fit's workers connect to.

Each round every worker pushes its flat parameters; the coordinator averages them weighted by
the samples each saw, measures how far the replicas drifted, and sends the average back. One
thread per worker moves bytes (socket calls release the GIL), so transfers overlap.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from sparkdl_avg import _wire
from sparkdl_avg._averaging import (
    is_finite,
    mean_distance,
    non_finite_replicas,
    weighted_average,
)
from sparkdl_avg._errors import ProtocolError, TrainingError, WorkerLostError

log = logging.getLogger("sparkdl_avg")
_POLL_S = 0.25
_MAX_STATE_FACTOR = 4
"""A push may carry the parameters plus optimizer state of up to 3x their size (Adam)."""
_JOB_FAILURE_WAIT_S = 5.0
"""After losing a worker's socket, how long to wait for Spark to say why the task died."""


@dataclass(slots=True)
class RoundStats:
    round: int
    samples: int
    train_loss: float
    compute_s: float
    round_s: float
    averaging_s: float
    divergence: float
    eval: dict | None = None
    states: list[tuple[list, np.ndarray]] | None = None
    """At checkpoint rounds: each worker's optimizer state (layout, bytes)."""
    phases: list[dict[str, tuple[float, float]]] | None = None
    """Per worker: (start, end) perf_counter times of setup, compute, transfer, waiting,
    averaging and return+eval, as the driver sees them."""


class Coordinator:
    """Owns the listening socket and the workers' connections; `close()` releases all."""

    def __init__(self, *, host: str, advertise: str, num_workers: int, secret: bytes,
                 timeout: float,
                 dtype: np.dtype, model_numel: int,
                 check_job: Callable[[float], None]) -> None:
        self.num_workers = num_workers
        self._secret = secret
        self._timeout = timeout
        self._check_job = check_job
        self._listener: socket.socket | None = None
        self._conns: dict[int, _wire.Connection] = {}
        self.hellos: dict[int, dict] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._host = host
        self._advertise = advertise
        self._dtype = np.dtype(dtype)
        self._buffers = [np.empty(model_numel, self._dtype) for _ in range(num_workers)]
        self.average = np.empty(model_numel, self._dtype)
        # optimizer state at checkpoints: at most 3x the parameters (Adam), in any dtype
        self._max_state_bytes = _MAX_STATE_FACTOR * model_numel * 8 + (1 << 20)
        self._round_end = time.perf_counter()

    def __enter__(self) -> Coordinator:
        self._listener = socket.create_server((self._host, 0), backlog=self.num_workers * 2)
        self._listener.settimeout(_POLL_S)
        self._port = self._listener.getsockname()[1]
        self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="sparkdl-avg-io")
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def address(self) -> tuple[str, int]:
        """Where the executors connect: the driver's advertised host and our port."""
        return self._advertise, self._port

    def close(self) -> None:
        for conn in self._conns.values():  # wakes any I/O thread blocked on a socket
            conn.close()
        self._conns.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # --- setup ----------------------------------------------------------------------------

    def accept_workers(self, initial: np.ndarray, deadline_s: float, *, start_round: int = 0,
                       states: list[tuple[list, np.ndarray]] | None = None) -> None:
        """Wait for every worker to connect and authenticate, then send the parameters to
        start from: before `start_round`, with each worker's optimizer state when restarting."""
        deadline = time.monotonic() + deadline_s
        while len(self._conns) < self.num_workers:
            self._check_job(0)
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.num_workers)) - set(self._conns))
                raise TrainingError(
                    f"workers for partitions {missing} did not connect within {deadline_s:.0f}s; "
                    "is the driver reachable from the executors (spark.driver.host)?"
                )
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            try:
                conn, hello = _wire.accept(sock, self._secret)
            except Exception as exc:  # a stranger or a broken peer must not end the fit
                log.warning("refused a connection from %s: %s", peer, exc)
                continue
            rank = hello.get("rank")
            if not isinstance(rank, int) or not 0 <= rank < self.num_workers \
                    or rank in self._conns:
                log.warning("refused a connection from %s: unexpected rank %r", peer, rank)
                with contextlib.suppress(OSError):
                    conn.send(_wire.Kind.ERROR, {"message": f"unexpected worker rank {rank!r}"})
                conn.close()
                continue
            conn.set_timeout(self._timeout)
            conn.max_payload = self._max_state_bytes
            self._conns[rank] = conn
            self.hellos[rank] = hello
        self._listener.close()  # everyone is here: nobody else may connect
        self._listener = None
        self.average[:initial.size] = initial  # the result if no round is left to run
        meta = {"round": start_round - 1, "state": states is not None}

        def send_start(rank: int, conn: _wire.Connection) -> None:
            conn.send(_wire.Kind.AVERAGE, meta, initial)
            if states is not None:
                layout, payload = states[rank]
                conn.send(_wire.Kind.STATE, {"layout": layout}, payload)

        self._all(send_start)
        self._round_end = time.perf_counter()

    # --- rounds ---------------------------------------------------------------------------

    def run_round(self, round_index: int, *, model_numel: int, allow_state: bool,
                  evaluate: bool, checkpoint: bool = False) -> RoundStats:
        pushes = self._all(lambda rank, conn: self._recv_push(rank, conn, round_index,
                                                              model_numel, allow_state))
        sizes = {p["numel"] for p in pushes}
        if len(sizes) != 1:
            raise TrainingError(f"workers pushed buffers of different sizes {sorted(sizes)} "
                                f"in round {round_index}")
        if self.average.size != sizes.pop():
            self.average = np.empty(self._buffers[0].size, self._dtype)
        t_avg = time.perf_counter()
        arrivals = [p.pop("_arrival") for p in pushes]
        weights = [p["samples"] for p in pushes]
        weighted_average(self._buffers, weights, self.average)
        if not is_finite(self.average):  # one scan; find the culprits only when needed
            raise TrainingError(
                f"worker(s) {non_finite_replicas(self._buffers)} pushed NaN/Inf parameters in "
                f"round {round_index}: training diverged; lower the learning rate or check "
                "the loss"
            )
        divergence = mean_distance([b[:model_numel] for b in self._buffers],
                                   self.average[:model_numel])
        t_averaged = time.perf_counter()
        averaging_s = t_averaged - t_avg
        meta = {"round": round_index, "eval": evaluate, "checkpoint": checkpoint}
        self._all(lambda rank, conn: conn.send(_wire.Kind.AVERAGE, meta, self.average))
        stats = RoundStats(
            round=round_index,
            samples=sum(weights),
            train_loss=sum(p["loss_sum"] for p in pushes) / max(1, sum(weights)),
            compute_s=max(p["compute_s"] for p in pushes),
            round_s=0.0,
            averaging_s=averaging_s,
            divergence=divergence,
        )
        if checkpoint:
            stats.states = self._all(self._recv_state)
        if evaluate:
            evals = self._all(lambda rank, conn: _checked_eval(
                rank, self._expect(rank, conn, _wire.Kind.EVAL).meta))
            count = sum(e["count"] for e in evals)
            stats.eval = {"loss": sum(e["loss_sum"] for e in evals) / max(1, count),
                          "time_s": max(e["eval_s"] for e in evals)}
            if all(e.get("correct") is not None for e in evals):  # classifiers only
                stats.eval["accuracy"] = sum(e["correct"] for e in evals) / max(1, count)
        now = time.perf_counter()
        stats.phases = _phases(self._round_end, [p.get("setup_s", 0.0) for p in pushes],
                               [p["compute_s"] for p in pushes], arrivals, t_averaged, now)
        stats.round_s, self._round_end = now - self._round_end, now
        return stats

    def finish(self) -> None:
        self._all(lambda rank, conn: self._expect(rank, conn, _wire.Kind.DONE))

    def _recv_push(self, rank: int, conn: _wire.Connection, round_index: int,
                   model_numel: int, allow_state: bool) -> dict:
        def target(kind: _wire.Kind, meta: dict) -> np.ndarray:
            numel = meta.get("numel")
            if not isinstance(numel, int) or numel < model_numel or (
                    numel != model_numel and not allow_state) \
                    or numel > _MAX_STATE_FACTOR * model_numel:
                raise ProtocolError(f"worker {rank} pushed {numel} values; the model has "
                                    f"{model_numel}")
            if self._buffers[rank].size != numel:  # grows once when optimizer state joins
                self._buffers[rank] = np.empty(numel, self._dtype)
            return self._buffers[rank]

        frame = self._expect(rank, conn, _wire.Kind.PUSH, into=target)
        meta = dict(frame.meta, _arrival=time.perf_counter())
        if frame.payload is None:
            raise ProtocolError(f"worker {rank} pushed no parameters")
        if meta.get("round") != round_index:
            raise ProtocolError(f"worker {rank} sent round {meta.get('round')} during round "
                                f"{round_index}")
        samples, loss_sum = meta.get("samples"), meta.get("loss_sum")
        if not isinstance(samples, int) or samples < 1 or not _is_number(loss_sum) \
                or not _is_number(meta.get("compute_s")) \
                or not _is_number(meta.get("setup_s", 0.0)):
            raise ProtocolError(f"worker {rank} sent a malformed PUSH: {meta}")
        return meta

    def _recv_state(self, rank: int, conn: _wire.Connection) -> tuple[list, np.ndarray]:
        frame = self._expect(rank, conn, _wire.Kind.STATE)
        layout = frame.meta.get("layout")
        if not isinstance(layout, list):
            raise ProtocolError(f"worker {rank} sent a malformed STATE: no layout")
        payload = np.frombuffer(frame.payload, np.uint8) if frame.payload is not None \
            else np.zeros(0, np.uint8)
        return layout, payload

    def _expect(self, rank: int, conn: _wire.Connection, kind: _wire.Kind,
                into: _wire.Into = None) -> _wire.Frame:
        try:
            frame = conn.recv(into)
        except TimeoutError:
            raise WorkerLostError(
                f"partition {rank} (host {self.hellos[rank].get('host')}) sent nothing for "
                f"{self._timeout:g}s (round_timeout): the task hangs or its executor is stuck",
                partition=rank) from None
        except (ProtocolError, OSError) as exc:
            raise WorkerLostError(f"lost the worker of partition {rank} (host "
                                  f"{self.hellos[rank].get('host')}): {exc}",
                                  partition=rank) from exc
        if frame.kind is _wire.Kind.ERROR:
            message = str(frame.meta.get("message", "?"))
            if frame.meta.get("fatal"):
                raise TrainingError(f"partition {rank} failed: {message}")
            raise WorkerLostError(f"partition {rank} failed: {message}", partition=rank,
                                  reported=message)
        if frame.kind is not kind:
            raise TrainingError(f"worker {rank} sent {frame.kind.name}, expected {kind.name}")
        return frame

    def _all(self, fn: Callable[[int, _wire.Connection], object]) -> list:
        """Run fn for every worker in parallel; fail fast (checking the Spark job) on errors."""
        assert self._pool is not None
        futures = [self._pool.submit(fn, rank, self._conns[rank])
                   for rank in range(self.num_workers)]
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=_POLL_S, return_when=FIRST_EXCEPTION)
            for f in done:
                if f.exception() is not None:
                    self._fail(f.exception())
            if pending:
                self._check_job(0)
        return [f.result() for f in futures]

    def _fail(self, exc: BaseException) -> None:
        if isinstance(exc, TrainingError) and not isinstance(exc, WorkerLostError):
            raise exc  # our own diagnosis (a fatal worker error, a bad frame): final
        # A lost worker usually means its task failed: give Spark a moment to say why,
        # unless the worker told us itself.
        reported = isinstance(exc, WorkerLostError) and exc.reported is not None
        self._check_job(0 if reported else _JOB_FAILURE_WAIT_S)
        if isinstance(exc, TrainingError):
            raise exc
        raise TrainingError(str(exc)) from exc


def _phases(start: float, setup: list[float], compute: list[float], arrivals: list[float],
            averaged: float, end: float) -> list[dict[str, tuple[float, float]]]:
    """Each worker's round as the driver sees it (see `_plots.PHASES`): setup, computing,
    transfer until its push arrived, waiting for the last push, the averaging, then sending
    the average (and evaluation when due) until the round ended. The worker's own durations
    are clamped into the driver's clock."""
    last = max(arrivals)
    out = []
    for s, c, arrived in zip(setup, compute, arrivals, strict=True):
        ready = min(start + max(s, 0.0), arrived)
        computed = min(ready + c, arrived)
        out.append({"setup": (start, ready), "compute": (ready, computed),
                    "transfer": (computed, arrived), "waiting": (arrived, last),
                    "averaging": (last, averaged), "return+eval": (averaged, end)})
    return out


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _checked_eval(rank: int, meta: dict) -> dict:
    count, correct = meta.get("count"), meta.get("correct")
    if not isinstance(count, int) or count < 0 or not _is_number(meta.get("loss_sum")) \
            or not _is_number(meta.get("eval_s")) \
            or not (correct is None or isinstance(correct, int)):
        raise ProtocolError(f"worker {rank} sent a malformed EVAL: {meta}")
    return meta
