"""The driver's side of the "driver" transport: a TCP server the fit's workers connect to.

Each round every worker pushes its flat parameters; the coordinator averages them weighted by
the samples each saw, measures how far the replicas drifted, and sends the average back. One
thread per worker moves bytes (socket calls release the GIL), so transfers overlap. Listening,
concurrent handshakes and refusals come from `net.server.Server`.
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import numpy as np

from sparkdl_avg._errors import (
    TASK_ERRORS,
    ProtocolError,
    TrainingError,
    WorkerLostError,
    from_task,
)
from sparkdl_avg._eval_sums import merge, payload_target, received_part
from sparkdl_avg.averaging.arithmetic import (
    average_and_diverge,
    non_finite_replicas,
)
from sparkdl_avg.averaging.global_step import GlobalStep
from sparkdl_avg.averaging.round_stats import RoundStats, phases, sum_or_nan
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.frames import Connection
from sparkdl_avg.net.server import Server, escaped

log = logging.getLogger("sparkdl_avg")
_POLL_S = 0.25
MAX_STATE_FACTOR = 4
"""A push may carry the parameters plus optimizer state of up to 3x their size (Adam)."""
_JOB_FAILURE_WAIT_S = 5.0
"""After losing a worker's socket, how long to wait for Spark to say why the task died."""
_AVERAGING_THREADS = min(os.cpu_count() or 1, 8)
"""Threads the average is split over (on the I/O pool, idle while it runs): every worker
waits for it, so it may take the driver's cores."""


class Coordinator(Server):
    """Owns the workers' connections and the averaging buffers; `close()` releases all."""

    def __init__(self, *, host: str, advertise: str, num_workers: int, secret: bytes,
                 timeout: float, dtype: np.dtype, model_numel: int,
                 check_job: Callable[[float], None], tls: ssl.SSLContext | None = None,
                 port: int = 0, step: GlobalStep | None = None) -> None:
        """`step`: what a round makes of the replicas beyond their plain average (an outer
        optimizer, compressed deltas); None: the plain average."""
        # room for each rank's retry beside a connection it replaces (`serve`)
        super().__init__(secret=secret, host=host, port=port,
                         max_connections=2 * num_workers, tls=tls, name="coordinator")
        self.num_workers = num_workers
        self._timeout = timeout
        self._check_job = check_job
        self._workers: dict[int, Connection] = {}
        self._sealed = False
        """Every rank connected and accept_workers goes on: no connection is replaced."""
        self.hellos: dict[int, msg.WorkerHello] = {}
        self._io: ThreadPoolExecutor | None = None
        self._advertise = advertise
        self._dtype = np.dtype(dtype)
        # a replica's buffer, allocated at its first push (never, with the collective one)
        self._buffers = [np.empty(0, self._dtype) for _ in range(num_workers)]
        self.average = np.empty(model_numel, self._dtype)
        # optimizer state at checkpoints: at most 3x the parameters (Adam), in any dtype
        self._max_state_bytes = MAX_STATE_FACTOR * model_numel * 8 + (1 << 20)
        self._round_end = time.perf_counter()
        self._bytes_mark = 0
        self.step = step
        self._compression = step.compression if step is not None else "none"
        if self._compression != "none":  # each push: a compressed delta
            self._buffers = [np.empty(step.payload.size, np.uint8) for _ in range(num_workers)]

    def start(self) -> None:
        super().start()
        self._io = ThreadPoolExecutor(max(self.num_workers, _AVERAGING_THREADS),
                                      thread_name_prefix="sparkdl-avg-io")

    @property
    def address(self) -> tuple[str, int]:
        """Where the executors connect: the driver's advertised host and our port."""
        return self._advertise, self._port

    def close(self) -> None:
        super().close()
        if self._io is not None:
            self._io.shutdown(wait=False, cancel_futures=True)
            self._io = None

    # --- setup ----------------------------------------------------------------------------

    def serve(self, conn: Connection, hello: dict) -> bool:
        """A worker connected and authenticated: keep its connection under its rank."""
        try:
            worker = msg.WorkerHello.from_meta(hello)
        except ProtocolError as exc:
            self.refuse(exc.reason, exc, hello, conn)
            return False
        conn.set_timeout(self._timeout)
        conn.max_payload = self._max_state_bytes
        with self._lock:
            known, stale = worker.rank < self.num_workers, None
            if known and not self._sealed:
                # The same rank again, before the fit starts: a retried connect whose first
                # try the worker gave up on, or Spark's next attempt of the task. Only the
                # rank's key gets here, so the newest connection is the live one.
                stale = self._workers.get(worker.rank)
                self._workers[worker.rank] = conn
                self.hellos[worker.rank] = worker
                self._conns.discard(stale)
                self._lock.notify_all()
                sealed = False
            else:
                sealed = self._sealed
        if known and not sealed:
            if stale is not None:
                log.info("worker rank %d connected again (%s): its earlier connection is "
                         "closed", worker.rank, escaped(worker.host))
                stale.close()
            return True
        # answered outside the lock, which the driver's loop polls under
        self.refuse("unexpected", f"worker rank {worker.rank} is "
                    f"{'taken: the fit has started' if known else 'unknown'}", worker.host,
                    conn)
        return False

    def accept_workers(self, initial: np.ndarray, deadline_s: float, *, start_round: int = 0,
                       states: list[tuple[list, np.ndarray]] | None = None,
                       vet: Callable[[list[msg.WorkerHello]], None] | None = None,
                       wait_next: bool = False, evaluate: bool = False,
                       global_state: tuple[list, np.ndarray] | None = None) -> dict | None:
        """Wait for every worker to connect and authenticate, let `vet` see their hellos (by
        rank; it raises to stop), then send the parameters to start from: before
        `start_round`, with each worker's optimizer state when restarting (and, to the
        collective transport's tasks, the outer optimizer's: `global_state`). `evaluate`: the
        workers evaluate those parameters first (round 0); returns the merged sums."""
        deadline = time.monotonic() + deadline_s
        while True:
            self._check_job(0)
            if self.failure is not None:
                raise TrainingError(f"the driver's coordinator cannot accept connections: "
                                    f"{self.failure!r}")
            with self._lock:
                if len(self._workers) == self.num_workers:
                    self._sealed = True  # these connections get the start: none replaced
                    break
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.num_workers)) - set(self._workers))
                    raise TrainingError(
                        f"workers for partitions {missing} did not connect within "
                        f"{deadline_s:.0f}s (connect_timeout); is the driver reachable from "
                        "the executors (spark.driver.host)?")
                self._lock.wait(_POLL_S)
        self.stop_accepting()  # everyone is here: nobody else may connect
        if vet is not None:
            vet([self.hellos[rank] for rank in range(self.num_workers)])
        self.average[:initial.size] = initial  # the result if no round is left to run
        start = msg.Average(round=start_round - 1, state_follows=states is not None,
                            wait_next=wait_next, evaluate=evaluate,
                            global_follows=global_state is not None, **msg.tensor(initial))

        def send_start(rank: int, conn: Connection) -> None:
            msg.send(conn, start, initial)
            if states is not None:
                layout, payload = states[rank]
                msg.send(conn, msg.State(layout=layout), payload)
            if global_state is not None:
                msg.send(conn, msg.State(layout=global_state[0]), global_state[1])

        self._all(send_start)
        result = self.evaluations() if evaluate else None
        self._round_end = time.perf_counter()
        self._bytes_in_round()  # rounds count from here
        return result

    # --- rounds ---------------------------------------------------------------------------

    def run_round(self, round_index: int, *, model_numel: int, allow_state: bool,
                  evaluate: bool, checkpoint: bool = False, stop: bool = False,
                  need_average: bool = True, wait_next: bool = False) -> RoundStats:
        """One round: every push, their average back (`stop`: as the last; the workers then
        send DONE), and what the driver asked for after it. `need_average`: whether the
        driver uses this round's average (here it always has it); `wait_next`: see
        `msg.Average`."""
        pushes = self._all(lambda rank, conn: self._recv_push(rank, conn, round_index,
                                                              model_numel, allow_state))
        sizes = {push.numel for push, _ in pushes}
        if len(sizes) != 1:
            raise TrainingError(f"workers pushed buffers of different sizes {sorted(sizes)} "
                                f"in round {round_index}")
        if self.average.size != sizes.pop():
            self.average = np.empty(self._buffers[0].size, self._dtype)
        t_avg = time.perf_counter()
        weights = [push.samples for push, _ in pushes]
        if self._compression == "none":
            out = self.average
            finite, divergence = average_and_diverge(
                self._buffers, weights, self.average, diverge_numel=model_numel,
                pool=self._io, threads=_AVERAGING_THREADS)
            outer_norm = self.step.after_average(round_index, self.average) \
                if finite and self.step is not None else None
        else:  # `average` is the global parameters, which take the update `payload` holds
            out = self.step.payload
            distances, outer_norm, finite = self.step.from_deltas(
                round_index, self._buffers, weights, self.average)
            divergence = float(np.mean(distances))
        if not finite:  # find the culprits only when needed
            raise TrainingError(
                f"worker(s) {self._non_finite()} pushed NaN/Inf parameters in "
                f"round {round_index}: training diverged; lower the learning rate or check "
                "the loss"
            )
        t_averaged = time.perf_counter()
        reply = msg.Average(round=round_index, evaluate=evaluate and not stop,
                            checkpoint=checkpoint and not stop, stop=stop,
                            wait_next=wait_next, encoding=self._compression,
                            **msg.tensor(self.average))
        evaluate, checkpoint = reply.evaluate, reply.checkpoint
        self._all(lambda rank, conn: msg.send(conn, reply, out))
        stats = RoundStats(
            samples=sum(weights),
            train_loss=sum_or_nan(push.loss_sum for push, _ in pushes) / max(1, sum(weights)),
            compute_s=max(push.compute_s for push, _ in pushes),
            round_s=0.0,
            averaging_s=t_averaged - t_avg,
            divergence=divergence,
            lr=pushes[0][0].lr,
            # every push up, the reply down to each worker
            wire_bytes=sum(b.nbytes for b in self._buffers) + self.num_workers * out.nbytes,
            outer_norm=outer_norm,
        )
        return self._finish_round(stats, pushes, t_averaged, checkpoint=checkpoint,
                                  evaluate=evaluate)

    def _non_finite(self) -> list[int]:
        """The ranks whose push held a NaN or an infinity (decoded, when compressed)."""
        if self._compression == "none":
            return non_finite_replicas(self._buffers)
        from sparkdl_avg.averaging.compression import decode

        values = np.empty(self.average.size, self._dtype)
        found = []
        for rank, payload in enumerate(self._buffers):
            decode(payload, self._compression, values)
            if not np.isfinite(values).all():
                found.append(rank)
        return found

    def _finish_round(self, stats: RoundStats, reports: list, t_averaged: float, *,
                      checkpoint: bool, evaluate: bool) -> RoundStats:
        """After the reply: the workers' optimizer state (checkpoint) and evaluations, then
        the round's timings. `reports`: (push or report, arrival time) by rank."""
        if checkpoint:
            stats.states = self._all(self._recv_state)
        if evaluate:
            stats.eval = self.evaluations()
        now = time.perf_counter()
        stats.phases = phases(self._round_end, [r.setup_s for r, _ in reports],
                               [r.compute_s for r, _ in reports],
                               [arrival for _, arrival in reports], t_averaged, now)
        stats.round_s, self._round_end = now - self._round_end, now
        stats.driver_bytes = self._bytes_in_round()
        return stats

    def evaluations(self) -> dict:
        """Every worker's evaluation, merged (`_eval_sums.merge`): the sums of the loss, the
        accuracy and each metric over all evaluation rows."""
        def receive(rank: int, conn: Connection) -> dict:
            message, payload = self._expect(rank, conn, msg.Eval, into=lambda m: (
                payload_target(m) if isinstance(m, msg.Eval) else None))
            try:
                return received_part(message, payload)
            except ProtocolError as exc:
                raise TrainingError(f"worker {rank} sent an evaluation that is {exc}") from None
        return merge(self._all(receive))

    def _bytes_in_round(self) -> int:
        """Bytes moved with the workers since the last call."""
        total = sum(conn.bytes_moved for conn in self._workers.values())
        moved, self._bytes_mark = total - self._bytes_mark, total
        return moved

    def finish(self) -> tuple[list, np.ndarray]:
        """Every worker's DONE; returns worker 0's integer buffers (layout, bytes): every
        replica took the same steps, so any one's count is the fit's."""
        done = self._all(lambda rank, conn: self._expect(rank, conn, msg.Done))
        message, payload = done[0]
        return message.layout, np.frombuffer(payload, np.uint8) if payload is not None \
            else np.zeros(0, np.uint8)

    def _recv_push(self, rank: int, conn: Connection, round_index: int, model_numel: int,
                   allow_state: bool) -> tuple[msg.Push, float]:
        def target(message: msg.Message) -> np.ndarray | None:
            if not isinstance(message, msg.Push):
                return None
            numel = message.numel
            self._check_size(f"worker {rank}", message, model_numel, allow_state)
            if message.encoding != self._compression:
                raise ProtocolError(f"worker {rank} sent values encoded as "
                                    f"{message.encoding!r}; this fit's are "
                                    f"{self._compression!r}", "shape")
            if self._compression != "none":  # a delta of exactly the model's size
                if numel != model_numel:
                    raise ProtocolError(f"worker {rank} sent a delta of {numel} values; the "
                                        f"model has {model_numel}", "shape")
            elif self._buffers[rank].size != numel:  # grows once when optimizer state joins
                self._buffers[rank] = np.empty(numel, self._dtype)
            return self._buffers[rank]

        push, _ = self._expect(rank, conn, msg.Push, into=target)
        if push.round != round_index:
            raise ProtocolError(f"worker {rank} sent round {push.round} during round "
                                f"{round_index}", "unexpected")
        return push, time.perf_counter()

    def _check_size(self, who: str, message, model_numel: int, allow_state: bool) -> None:
        """Refuse (reason "shape") parameters in another dtype than the wire's, or of another
        size than the model's (plus up to 3x of optimizer state, when it is averaged too)."""
        numel = message.numel
        if message.dtype != self._dtype.name:
            raise ProtocolError(f"{who} sent {message.dtype} values; the wire dtype is "
                                f"{self._dtype}", "shape")
        if numel < model_numel or (numel != model_numel and not allow_state) \
                or numel > MAX_STATE_FACTOR * model_numel:
            raise ProtocolError(f"{who} sent {numel} values; the model has {model_numel}",
                                "shape")

    def _recv_state(self, rank: int, conn: Connection) -> tuple[list, np.ndarray]:
        state, payload = self._expect(rank, conn, msg.State)
        data = np.frombuffer(payload, np.uint8) if payload is not None \
            else np.zeros(0, np.uint8)
        return state.layout, data

    def _expect(self, rank: int, conn: Connection, cls: type[msg.M],
                into=None) -> tuple[msg.M, memoryview | None]:
        host = self.hellos[rank].host
        try:
            message, payload = msg.receive(conn, into)
        except TimeoutError:
            raise WorkerLostError(
                f"partition {rank} (host {host}) sent nothing for {self._timeout:g}s "
                "(round_timeout): the task hangs or its executor is stuck",
                partition=rank, host=host) from None
        except (ProtocolError, OSError) as exc:
            raise WorkerLostError(f"lost the worker of partition {rank} (host {host}): {exc}",
                                  partition=rank, host=host) from exc
        if isinstance(message, msg.WorkerFailed):
            if message.final:
                raise from_task(f"partition {rank}", message.message)
            raise WorkerLostError(f"partition {rank} failed: {message.message}",
                                  partition=rank, reported=message.message, host=host)
        if not isinstance(message, cls):
            raise TrainingError(f"worker {rank} sent {message.KIND.name}, expected "
                                f"{cls.KIND.name}")
        return message, payload

    def _all(self, fn: Callable[[int, Connection], object]) -> list:
        """Run fn for every worker in parallel; fail fast (checking the Spark job) on errors."""
        futures = [self._io.submit(fn, rank, self._workers[rank])
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
        if isinstance(exc, (TrainingError, *TASK_ERRORS)) \
                and not isinstance(exc, WorkerLostError):
            raise exc  # our own diagnosis (a final worker error, a NaN): final
        # A lost worker usually means its task failed: give Spark a moment to say why,
        # unless the worker told us itself.
        reported = isinstance(exc, WorkerLostError) and exc.reported is not None
        self._check_job(0 if reported else _JOB_FAILURE_WAIT_S)
        if isinstance(exc, TrainingError):
            raise exc
        raise TrainingError(str(exc)) from exc
