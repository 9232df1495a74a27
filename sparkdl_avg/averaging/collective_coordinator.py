"""The driver's side of the "collective" transport: the control plane only.

The tasks average among themselves (`collective`); each round the driver receives every
worker's `Report` (its numbers, its distance from the average, what was finite), answers with
`Orders`, and takes worker 0's copy of the average only when it uses it: at checkpoints, at
evaluations that early stopping judges, every round when `on_round` may stop the fit, and at
the end. Connections, restarts, checkpoints' optimizer state, evaluations and the watchdog
are the coordinator's, as with the driver transport."""

from __future__ import annotations

import time

import numpy as np

from sparkdl_avg._errors import ProtocolError, TrainingError
from sparkdl_avg.averaging.compression import encoded_nbytes
from sparkdl_avg.averaging.coordinator import Coordinator
from sparkdl_avg.averaging.round_stats import RoundStats, sum_or_nan
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.frames import Connection


class CollectiveCoordinator(Coordinator):
    def __init__(self, *, compression: str = "none", global_state: bool = False,
                 **kwargs) -> None:
        """`compression`: the tasks all-gather compressed deltas instead of all-reducing
        their replicas; `global_state`: worker 0 sends its `GlobalStep` state (an outer
        optimizer's, the update's residual) after the average at checkpoints."""
        super().__init__(**kwargs)
        self._compression, self._global_state = compression, global_state

    def run_round(self, round_index: int, *, model_numel: int, allow_state: bool,
                  evaluate: bool, checkpoint: bool = False, stop: bool = False,
                  need_average: bool = True, wait_next: bool = False) -> RoundStats:
        """One round: every report, the orders back, then the average (`need_average`, or a
        checkpoint) from worker 0, and what the driver asked for after it."""
        reports = self._all(lambda rank, conn: self._recv_report(rank, conn, round_index))
        t_reduced = time.perf_counter()
        lost = [rank for rank, (r, _) in enumerate(reports) if not r.replica_finite]
        if lost or not all(r.average_finite for r, _ in reports):
            culprits = f"worker(s) {lost} pushed" if lost else \
                "the replicas were finite, but their average overflowed to"
            raise TrainingError(f"{culprits} NaN/Inf parameters in round {round_index}: "
                                "training diverged; lower the learning rate or check the loss")
        orders = msg.Orders(round=round_index, evaluate=evaluate and not stop,
                            checkpoint=checkpoint and not stop, stop=stop,
                            send_average=(need_average or checkpoint) and not stop,
                            wait_next=wait_next)
        self._all(lambda rank, conn: msg.send(conn, orders))
        global_state = None
        if orders.send_average:
            global_state = self._recv_average(round_index, model_numel, allow_state,
                                              orders.checkpoint)
        weights = [r.samples for r, _ in reports]
        stats = RoundStats(
            samples=sum(weights),
            train_loss=sum_or_nan(r.loss_sum for r, _ in reports) / max(1, sum(weights)),
            compute_s=max(r.compute_s for r, _ in reports),
            round_s=0.0,
            # the first to arrive waits for the last: the quickest saw the all-reduce alone
            averaging_s=min(r.reduce_s for r, _ in reports),
            divergence=_mean_or_nan([r.distance for r, _ in reports]),
            lr=reports[0][0].lr,
            has_average=orders.send_average,
            wire_bytes=self._wire_bytes(model_numel),
            outer_norm=reports[0][0].outer_norm,
            global_state=global_state,
            workers=self.num_workers,
        )
        return self._finish_round(stats, reports, t_reduced, checkpoint=orders.checkpoint,
                                  evaluate=orders.evaluate)

    def _recv_report(self, rank: int, conn: Connection,
                     round_index: int) -> tuple[msg.Report, float]:
        report, _ = self._expect(rank, conn, msg.Report)
        if report.round != round_index:
            raise ProtocolError(f"worker {rank} reported round {report.round} during round "
                                f"{round_index}", "unexpected")
        return report, time.perf_counter()

    def _wire_bytes(self, numel: int) -> int:
        """What the tasks' collective moved, as a ring moves it (gloo's and NCCL's choice
        for large tensors; not measured): an all-reduce of S bytes sends 2(n-1)/n S from
        each of the n tasks; an all-gather of n pieces of s bytes, (n-1) s from each."""
        n = self.num_workers
        if self._compression != "none":
            return n * (n - 1) * encoded_nbytes(self._compression, numel)
        return 2 * (n - 1) * numel * self._dtype.itemsize

    def _recv_average(self, round_index: int, model_numel: int, allow_state: bool,
                      checkpoint: bool) -> tuple[list, np.ndarray] | None:
        """Worker 0's average into `average` (with the optimizer state that rides with the
        parameters when it is averaged too); at a checkpoint, its `GlobalStep` state."""
        def target(message: msg.Message) -> np.ndarray | None:
            if not isinstance(message, msg.Averaged):
                return None
            self._check_size("worker 0's average", message, model_numel, allow_state)
            if self.average.size != message.numel:
                self.average = np.empty(message.numel, self._dtype)
            return self.average

        averaged, _ = self._expect(0, self._workers[0], msg.Averaged, into=target)
        if averaged.round != round_index:
            raise ProtocolError(f"worker 0 sent the average of round {averaged.round} during "
                                f"round {round_index}", "unexpected")
        if checkpoint and self._global_state:
            state, payload = self._expect(0, self._workers[0], msg.State)
            return state.layout, np.frombuffer(payload, np.uint8) if payload is not None \
                else np.zeros(0, np.uint8)
        return None



def _mean_or_nan(distances: list[float | None]) -> float:
    """The replicas' mean distance; NaN when one overflowed (sent as None)."""
    return float("nan") if None in distances else float(np.mean(distances))
