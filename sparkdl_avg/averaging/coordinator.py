"""The driver's side of the "driver" transport: a TCP server the fit's workers connect to.

Each round every worker pushes its flat parameters; the coordinator averages them weighted by
the samples each saw, measures how far the replicas drifted, and sends the average back. One
thread per worker moves bytes (socket calls release the GIL), so transfers overlap. The
connections, and an elastic fit's comings and goings, are `worker_links.WorkerLinks`';
listening, concurrent handshakes and refusals `net.server.Server`'s.

A worker on the driver's host (`shared_memory`) names a region of its own in its hello: the
coordinator averages straight out of it, into a region of its own that such workers read
the average from (`net.shared_memory`); the frames on the socket then only name them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import ssl
import time
from collections.abc import Callable

import numpy as np

from sparkdl_avg._errors import (
    ProtocolError,
    TrainingError,
)
from sparkdl_avg._eval_sums import merge, payload_target, received_part
from sparkdl_avg.averaging.arithmetic import (
    average_and_diverge,
    non_finite_replicas,
)
from sparkdl_avg.averaging.global_step import GlobalStep
from sparkdl_avg.averaging.membership import Membership
from sparkdl_avg.averaging.round_stats import RoundStats, phases, sum_or_nan
from sparkdl_avg.averaging.worker_links import POLL_S, WorkerLinks
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.frames import Connection
from sparkdl_avg.net.shared_memory import SharedRegion

log = logging.getLogger("sparkdl_avg")
MAX_STATE_FACTOR = 4
"""A push may carry the parameters plus optimizer state of up to 3x their size (Adam)."""
_AVERAGING_THREADS = min(os.cpu_count() or 1, 8)
"""Threads the average is split over (on the I/O pool, idle while it runs): every worker
waits for it, so it may take the driver's cores."""


class Coordinator(WorkerLinks):
    """Owns the workers' connections and the averaging buffers; `close()` releases all."""

    def __init__(self, *, host: str, advertise: str, num_workers: int, secret: bytes,
                 timeout: float, dtype: np.dtype, model_numel: int,
                 check_job: Callable[[float], None], tls: ssl.SSLContext | None = None,
                 port: int = 0, step: GlobalStep | None = None,
                 elastic: Membership | None = None, shared_memory: bool = False) -> None:
        """`step`: what a round makes of the replicas beyond their plain average (an outer
        optimizer, compressed deltas); None: the plain average. `elastic`: an elastic fit's
        membership (`min_workers`); None: every worker in every round, a loss fails it.
        `shared_memory`: map the regions workers on this host name (`TrainConfig`)."""
        super().__init__(secret=secret, host=host, port=port, num_workers=num_workers,
                         timeout=timeout, check_job=check_job, tls=tls, elastic=elastic,
                         threads=max(num_workers, _AVERAGING_THREADS))
        self._model_numel = model_numel
        self._advertise = advertise
        self._dtype = np.dtype(dtype)
        # a replica's buffer, allocated at its first push (never, with the collective one)
        self._buffers = [np.empty(0, self._dtype) for _ in range(num_workers)]
        self.average = np.empty(model_numel, self._dtype)
        # optimizer state at checkpoints: at most 3x the parameters (Adam), in any dtype
        self.max_payload = MAX_STATE_FACTOR * model_numel * 8 + (1 << 20)
        self._round_end = time.perf_counter()
        self.step = step
        self._compression = step.compression if step is not None else "none"
        if self._compression != "none":  # each push: a compressed delta
            self._buffers = [np.empty(step.payload.size, np.uint8) for _ in range(num_workers)]
        self._sharing = shared_memory
        self._shared: SharedRegion | None = None
        """Where the average is, once a worker on this host has mapped its own region."""

    # --- shared memory with workers on this host --------------------------------------------

    def serve(self, conn: Connection, hello: dict) -> bool:
        """Map the region a worker's hello names, if it is on this host, before the worker
        is kept (`WorkerLinks.serve`)."""
        if self._sharing:
            with contextlib.suppress(ProtocolError):  # the hello's refusal is serve's
                shared = msg.WorkerHello.from_meta(hello).shared
                if shared:
                    conn.shared_in = SharedRegion.attach(shared, self.average.nbytes)
                    if conn.shared_in is not None:  # mapped: its name can go at once
                        conn.shared_in.unlink(peers=True)
        if conn.shared_in is not None and self._shared is None and not self._sealed:
            made = SharedRegion.create(self.average.nbytes)  # outside the lock: it sweeps
            with self._lock:
                if made is not None and self._shared is None and not self._sealed:
                    # before any average is out: from now on the average lives there
                    self._shared, made = made, None
                    self.average = self._shared.array(self._dtype, self._model_numel)
            if made is not None:
                made.close()
        kept = super().serve(conn, hello)
        if conn.shared_in is not None and kept:
            log.info("worker rank %s is on the driver's host: its pushes come through shared "
                     "memory", hello.get("rank"))
        return kept

    def _start_for(self, conn: Connection, start: msg.Average) -> msg.Average:
        """`start` as a worker is told it: whether its region is mapped here, and ours."""
        if conn.shared_in is None:
            return start
        return dataclasses.replace(start, shared_up=True, shared=self._shared.name
                                   if self._shared is not None else "")

    def _average_buffer(self, numel: int) -> np.ndarray:
        """Where `numel` averaged values go: the shared region when they fit."""
        shared = self._shared.array(self._dtype, numel) if self._shared is not None else None
        return shared if shared is not None else np.empty(numel, self._dtype)

    def close(self) -> None:
        super().close()
        if self._shared is not None:  # mapped until the last view of the average is gone
            self._shared.close()

    # --- setup ----------------------------------------------------------------------------

    def accept_workers(self, initial: np.ndarray, deadline_s: float, *, start_round: int = 0,
                       states: list[tuple[list, np.ndarray]] | None = None,
                       vet: Callable[[list[msg.WorkerHello]], None] | None = None,
                       wait_next: bool = False, evaluate: bool = False,
                       global_state: tuple[list, np.ndarray] | None = None,
                       start_with: int | None = None) -> dict | None:
        """Wait for every worker to connect and authenticate, let `vet` see their hellos (by
        rank; it raises to stop), then send the parameters to start from: before
        `start_round`, with each worker's optimizer state when restarting (and, to the
        collective transport's tasks, the outer optimizer's: `global_state`). `evaluate`: the
        workers evaluate those parameters first (round 0); returns the merged sums. An
        elastic fit starts with `start_with` workers (the slots it has; default all), or at
        the deadline with at least min_workers; the others join at a round boundary."""
        deadline = time.monotonic() + deadline_s
        enough = self.num_workers if self.elastic is None else start_with or self.num_workers
        while True:
            self._check_job(0)
            if self.failure is not None:
                raise TrainingError(f"the driver's coordinator cannot accept connections: "
                                    f"{self.failure!r}")
            with self._lock:
                late = time.monotonic() > deadline
                if len(self._workers) >= enough or (late and self.elastic is not None and len(
                        self._workers) >= self.elastic.min_workers):
                    self._sealed = True  # these connections get the start: none replaced
                    break
                if late:
                    missing = sorted(set(range(self.num_workers)) - set(self._workers))
                    raise TrainingError(
                        f"workers for partitions {missing} did not connect within "
                        f"{deadline_s:.0f}s (connect_timeout); is the driver reachable from "
                        "the executors (spark.driver.host)?")
                self._lock.wait(POLL_S)
        if self.elastic is None:
            self.stop_accepting()  # everyone is here: nobody else may connect
        else:  # a late task joins at a round boundary
            for rank in sorted(set(range(self.num_workers)) - set(self._workers)):
                self.elastic.absent_from_start(rank, start_round)
        if vet is not None and len(self._workers) == self.num_workers:
            vet([self.hellos[rank] for rank in range(self.num_workers)])
        self.average[:initial.size] = initial  # the result if no round is left to run
        start = msg.Average(round=start_round - 1, state_follows=states is not None,
                            wait_next=wait_next, evaluate=evaluate,
                            global_follows=global_state is not None, **msg.tensor(initial))

        def send_start(rank: int, conn: Connection) -> None:
            msg.send(conn, self._start_for(conn, start), initial)
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
        received = {}
        while not received:  # elastic: each present worker's push, or else its leaving
            if self.elastic is not None:
                self._let_join(round_index, self._send_joining_start(round_index))
            self._at = (round_index, False)
            received = self._each(lambda rank, conn: self._recv_push(
                rank, conn, round_index, model_numel, allow_state))
        ranks, pushes = list(received), list(received.values())
        buffers = [self._buffers[rank] for rank in ranks]
        sizes = {push.numel for push, _ in pushes}
        if len(sizes) != 1:
            raise TrainingError(f"workers pushed buffers of different sizes {sorted(sizes)} "
                                f"in round {round_index}")
        if self.average.size != sizes.pop():
            self.average = self._average_buffer(buffers[0].size)
        t_avg = time.perf_counter()
        weights = [push.samples for push, _ in pushes]
        if self._compression == "none":
            out = self.average
            finite, divergence = average_and_diverge(
                buffers, weights, self.average, diverge_numel=model_numel,
                pool=self._io, threads=_AVERAGING_THREADS)
            outer_norm = self.step.after_average(round_index, self.average) \
                if finite and self.step is not None else None
        else:  # `average` is the global parameters, which take the update `payload` holds
            out = self.step.payload
            distances, outer_norm, finite = self.step.from_deltas(
                round_index, buffers, weights, self.average)
            divergence = float(np.mean(distances))
        if not finite:  # find the culprits only when needed
            raise TrainingError(
                f"worker(s) {self._non_finite(ranks)} pushed NaN/Inf parameters in "
                f"round {round_index}: training diverged; lower the learning rate or check "
                "the loss"
            )
        t_averaged = time.perf_counter()
        reply = msg.Average(round=round_index, evaluate=evaluate and not stop,
                            checkpoint=checkpoint and not stop, stop=stop,
                            wait_next=wait_next, encoding=self._compression,
                            **msg.tensor(self.average))
        evaluate, checkpoint = reply.evaluate, reply.checkpoint
        self._at = (round_index, True)
        self._each(lambda rank, conn: msg.send(conn, reply, out))
        stats = RoundStats(
            samples=sum(weights),
            train_loss=sum_or_nan(push.loss_sum for push, _ in pushes) / max(1, sum(weights)),
            compute_s=max(push.compute_s for push, _ in pushes),
            round_s=0.0,
            averaging_s=t_averaged - t_avg,
            divergence=divergence,
            lr=pushes[0][0].lr,
            # every push up, the reply down to each worker
            wire_bytes=sum(b.nbytes for b in buffers) + len(ranks) * out.nbytes,
            outer_norm=outer_norm,
            workers=len(ranks),
        )
        return self._finish_round(stats, pushes, t_averaged, checkpoint=checkpoint,
                                  evaluate=evaluate, ranks=ranks)

    def _send_joining_start(self, round_index: int) -> Callable[[Connection], None]:
        """What a worker joining an elastic fit before round `round_index` gets: the global
        parameters, as a start before that round (its optimizer state it rebuilds)."""
        params = self.average[:self._model_numel]
        start = msg.Average(round=round_index - 1, **msg.tensor(params))
        return lambda conn: msg.send(conn, self._start_for(conn, start), params)

    def _non_finite(self, ranks: list[int]) -> list[int]:
        """Which of `ranks` pushed a NaN or an infinity (decoded, when compressed)."""
        if self._compression == "none":
            return [ranks[i] for i in non_finite_replicas([self._buffers[r] for r in ranks])]
        from sparkdl_avg.averaging.compression import decode

        values = np.empty(self.average.size, self._dtype)
        found = []
        for rank in ranks:
            decode(self._buffers[rank], self._compression, values)
            if not np.isfinite(values).all():
                found.append(rank)
        return found

    def _finish_round(self, stats: RoundStats, reports: list, t_averaged: float, *,
                      checkpoint: bool, evaluate: bool,
                      ranks: list[int] | None = None) -> RoundStats:
        """After the reply: the workers' optimizer state (checkpoint) and evaluations, then
        the round's timings. `reports`: (push or report, arrival time) of `ranks` (default
        all); the phases of a rank not among them are empty."""
        if checkpoint:  # by rank: an elastic fit's lacks the workers not present
            stats.states = self._each(self._recv_state)
        if evaluate:
            stats.eval = self.evaluations()
        now = time.perf_counter()
        seen = dict(zip(ranks or range(self.num_workers), phases(
            self._round_end, [r.setup_s for r, _ in reports], [r.compute_s for r, _ in reports],
            [arrival for _, arrival in reports], t_averaged, now), strict=True))
        stats.phases = [seen.get(rank, {}) for rank in range(self.num_workers)]
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
        return merge(list(self._each(receive).values()))

    def finish(self) -> tuple[list, np.ndarray]:
        """Every worker's DONE; returns the lowest rank's integer buffers (layout, bytes):
        every replica took the same steps, so any one's count is the fit's. In an elastic fit,
        the lowest rank's that was never away: a returning worker's counts restarted."""
        done = self._each(lambda rank, conn: self._expect(rank, conn, msg.Done))
        if self.elastic is not None:
            self._end_elastic()
        if not done:  # every worker left after the last average: no counts to take
            return [], np.zeros(0, np.uint8)
        away = self.elastic.ever_away() if self.elastic is not None else set()
        message, payload = done[min(set(done) - away, default=min(done))]
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
            elif conn.shared_in is not None and \
                    (shared := conn.shared_in.array(self._dtype, numel)) is not None:
                self._buffers[rank] = shared  # averaged where the worker put it
            elif self._buffers[rank].size != numel or self._buffers[rank].base is not None:
                self._buffers[rank] = np.empty(numel, self._dtype)  # optimizer state joined
            return self._buffers[rank]

        push, _ = self._expect(rank, conn, msg.Push, into=target)
        if push.shared_down and conn.shared_out is None and conn.shared_in is not None:
            conn.shared_out = self._shared  # it mapped ours: averages go through it
            log.info("worker rank %d reads the averages from shared memory", rank)
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

    @property
    def address(self) -> tuple[str, int]:
        """Where the executors connect: the driver's advertised host and our port."""
        return self._advertise, self._port
