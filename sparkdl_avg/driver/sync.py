"""Sync mode on the driver: a coordinator and a barrier job per attempt, every round averaged,
every `checkpoint_every` rounds (or 30 s) a restart point kept (and saved). When a task fails,
hangs or disconnects, Spark aborts the whole barrier job; the restart loop starts a new one
from the last restart point. The workers take up the data where that point left off, so with a fixed
seed the result is bit-identical to a run without the failure."""

from __future__ import annotations

import contextlib
import logging
import time

from sparkdl_avg._errors import WorkerLostError
from sparkdl_avg.averaging.collective_coordinator import CollectiveCoordinator
from sparkdl_avg.averaging.coordinator import Coordinator
from sparkdl_avg.averaging.flat_buffer import FlatBuffer, averaged_tensors, wire_dtype
from sparkdl_avg.averaging.global_step import GlobalStep
from sparkdl_avg.averaging.membership import Membership, carried_states
from sparkdl_avg.averaging.round_stats import RoundStats
from sparkdl_avg.driver.barrier import BarrierJob
from sparkdl_avg.driver.checkpoints import (
    Checkpoint,
    MlflowStore,
    check_saved,
    end_source_run,
    target_store,
    writing,
)
from sparkdl_avg.driver.cluster import driver_address
from sparkdl_avg.driver.early_stop import Stopping
from sparkdl_avg.driver.plan import FitPlan, TrainOutcome
from sparkdl_avg.driver.restarts import Restarts
from sparkdl_avg.driver.resume_checks import check_devices, check_resumable, fingerprint
from sparkdl_avg.net.auth import new_secret
from sparkdl_avg.net.tls import read_certificates, server_context
from sparkdl_avg.task import worker_state
from sparkdl_avg.task.evaluate import eval_metrics
from sparkdl_avg.task.worker_state import pack_entries, unpack
from sparkdl_avg.tracking.plots import worker_timeline
from sparkdl_avg.tracking.progress import Progress
from sparkdl_avg.tracking.run import RunLogger

log = logging.getLogger("sparkdl_avg")
CHECKPOINT_INTERVAL_S = 30.0
"""With `checkpoint_every=None`, the least training time between two checkpoints: each one
moves every worker's optimizer state to the driver and writes it out, which rounds of tens of
milliseconds would otherwise pay for every few rounds."""


def train_sync(spark, plan: FitPlan, run: RunLogger) -> TrainOutcome:
    """Train to the end, restarting after task failures; the final average ends up in
    `plan.model`."""
    config = plan.config
    flat = FlatBuffer(averaged_tensors(plan.model), wire_dtype(plan.dtype))
    expected = fingerprint(config, train_rows=plan.data.train_sizes,
                           data=plan.params_of_data(), model_numel=flat.array.size,
                           dtype=str(plan.dtype), total_steps=plan.schedule.total_steps,
                           frozen=plan.frozen)
    resume = plan.resume
    store = target_store(config, run.run_id, run.tracking_uri,
                         resume.source if resume is not None else None)
    if resume is not None:
        point = resume.point
        check_resumable(point, expected, schedule=plan.schedule,
                        source=resume.source.description)
        run.log_params({"resumed_from": resume.source.description,
                        "resumed_at_round": point.round})
        if isinstance(resume.source, MlflowStore):
            end_source_run(run.tracking_uri, resume.source.run_id)
    else:
        point = Checkpoint(round=0, steps=0, params=flat.gather().copy(), states=None,
                           fingerprint=expected)
    attempt = _Attempt(spark, plan, flat, run, point, expected)
    attempt.stopper = Stopping(config.early_stopping, plan.on_round, best=point.best)
    attempt.stopper.take_up(point.stop, point.history, point.params)
    if point.stop is not None:  # the stop's round as logged: rounds done
        attempt.stop_round = point.stop["round"] - 1
    restarts = Restarts(spark, config, run)
    with contextlib.closing(attempt.progress), writing(store) as attempt.writer:
        workers = restarts.run(attempt.run, resume_at=lambda exc: f"round {attempt.point.round}",
                               step=lambda: attempt.point.round)
        train_s = time.perf_counter() - attempt.t_train
    attempt.stopper.record(run, attempt.history)
    run.log_dict_quietly({"rounds": attempt.timeline}, "worker_timeline.json")
    run.log_figure(lambda: worker_timeline(attempt.timeline, config.num_workers),
                   "plots/worker_timeline.png")
    return TrainOutcome(history=attempt.history, workers=workers,
                        failures=restarts.failures + attempt.elastic_records,
                        first_step_at=attempt.t_train, train_s=train_s)


class _Attempt:
    """One barrier job's worth of rounds, from the restart point `point`; each checkpoint
    round moves `point` on."""

    def __init__(self, spark, plan: FitPlan, flat: FlatBuffer, run: RunLogger,
                 point: Checkpoint, expected: dict) -> None:
        self.spark, self.plan, self.flat, self.run_logger = spark, plan, flat, run
        self.point, self.expected = point, expected
        config = plan.config
        self.tls = server_context(config.tls_cert, config.tls_key) if config.tls_cert \
            else None
        ca, what = (config.tls_ca, "tls_ca") if config.tls_ca else (config.tls_cert, "tls_cert")
        self.tls_ca_pem = read_certificates(ca, what) if config.tls_cert else None
        self.history: list[dict] = list(point.history)
        self.progress = Progress(plan.schedule.num_rounds)
        self.writer = None
        self.t_train = 0.0
        self.checkpointed_at = 0.0
        """perf_counter() at the last checkpoint, or when this attempt began training."""
        self.orders = (False, False)
        """With overlap_averaging, the next round's (evaluate, checkpoint): `_orders`."""
        self.stopper: Stopping | None = None
        self.stop_round: int | None = None
        """The round (its index; -1: round 0, before training) at which early stopping or
        on_round stopped the fit: the workers take the next round's steps, and its average
        is their last (it is not logged)."""
        self.elastic_records: list[dict] = []
        """An elastic fit's losses and returns (`averaging.membership`), over all attempts."""
        self.timeline: list[dict] = []
        """Per round: each worker's phases, seconds since training began (for the picture)."""
        self.step: GlobalStep | None = None
        """With the "driver" transport, an outer optimizer or compression: the driver's
        side of every round, its state taken up from each attempt's restart point."""
        if config.transport == "driver" and (plan.outer is not None
                                             or config.delta_compression != "none"):
            self.step = GlobalStep(numel=flat.array.size, dtype=flat.array.dtype,
                                   outer=plan.outer, compression=config.delta_compression,
                                   warmup_rounds=plan.schedule.warmup_rounds)

    def run(self) -> list[dict]:
        plan, config, flat, point = self.plan, self.plan.config, self.flat, self.point
        waits = config.waits()
        secret = new_secret()
        address = driver_address(self.spark, config)
        elastic = Membership(config.min_workers, self.elastic_records,
                             plan.schedule.rows_in_rounds) \
            if config.min_workers is not None else None
        if config.transport == "collective":
            coordinator, extra = CollectiveCoordinator, {
                "compression": config.delta_compression,
                "global_state": plan.outer is not None or config.delta_compression != "none"}
        else:
            coordinator, extra = Coordinator, {"step": self.step, "elastic": elastic,
                                               "shared_memory": config.shared_memory}
            if self.step is not None:  # the outer state and residual of the restart point
                self.step.restore(unpack(*point.global_state) if point.global_state
                                  else {}, point.params)
        with coordinator(
            host=address.bind, port=address.port, advertise=address.advertise,
            num_workers=config.num_workers, secret=secret,
            timeout=waits.round, dtype=flat.array.dtype, model_numel=flat.array.size,
            check_job=lambda wait_s: job.check(wait_s), tls=self.tls, **extra,
        ) as coord, BarrierJob.training(
            plan.data.frame, plan.worker_spec(coord.address, self.tls_ca_pem),
            f"sparkdl-avg: train {config.num_workers} replicas from round {point.round}",
            config, self.run_logger, secret=secret,
            evict=coord.evict if elastic is not None else None,
        ) as job:
            try:
                if config.overlap_averaging:  # its checkpoint_every is a number of rounds
                    self.orders = self._orders(point.round)
                first = coord.accept_workers(
                    point.params, waits.connect, start_round=point.round, states=point.states,
                    vet=self._check_devices, wait_next=any(self.orders),
                    evaluate=self._evaluates_first(),
                    global_state=point.global_state if config.transport == "collective"
                    else None, start_with=elastic_start(self.spark, config))
                if first is not None:
                    self._log_first(first)
                self.t_train = self.t_train or time.perf_counter()
                self.checkpointed_at = time.perf_counter()
                for r in range(point.round, plan.schedule.num_rounds):
                    stop = self.stop_round is not None and r > self.stop_round
                    self._round(coord, r, stop=stop)
                    if stop:
                        break
                buffers = coord.finish()
                if elastic is not None:
                    elastic.close_open(plan.schedule.num_rounds)
                final = self.stopper.result()
                flat.array[:] = coord.average[:flat.array.size] if final is None else final
                flat.scatter()
                worker_state.restore(None, plan.model, *buffers)
                rows = job.wait(waits.finish)
            except WorkerLostError:
                coord.close()  # the surviving workers stop waiting for the next average
                raise
        return sorted((row.asDict() for row in rows), key=lambda w: w["partition"])

    def _evaluates_first(self) -> bool:
        """Whether this attempt evaluates the start parameters as round 0: once a fit, before
        anything is logged (`TrainConfig.evaluates_first`); never on a resumed fit."""
        return self.point.round == 0 and not self.history and \
            self.plan.config.evaluates_first(self.plan.data.eval_sizes[0] > 0)

    def _log_first(self, result: dict) -> None:
        """Round 0: the evaluation before training, logged at step 0; early stopping and
        on_round see it as any round (the best may be the start)."""
        metrics = eval_metrics(result, self.plan.objective.metrics)
        row = {"round": 0, **metrics}
        self.history.append(row)
        self.run_logger.log_metrics(metrics, step=0)
        self.progress.first(metrics)
        params = self.point.params
        if self.stopper.judge(self.history, row, params) or self.stopper.ask(row, params):
            self.stop_round = -1

    def _check_devices(self, hellos: list) -> None:
        """The restart point's recorded devices against the workers' (`check_devices`); the
        devices this attempt trains on are then the ones its checkpoints record."""
        devices = [hello.device for hello in hellos]
        check_devices(self.point, devices, deterministic=self.plan.config.deterministic)
        if self.expected.get("devices") != devices:
            # a new dict: checkpoints still being written keep the devices they came from
            self.expected = {**self.expected, "devices": devices}
            self.run_logger.set_tags({"sparkdl_avg.devices": ", ".join(sorted(set(devices)))})

    def _checkpoints_after(self, r: int, last: bool) -> bool:
        """Whether round `r` ends with a checkpoint (`TrainConfig.checkpoint_every`); by time,
        a yes also starts the next interval (`checkpointed_at`)."""
        every = self.plan.config.checkpoint_every
        if every == 0:
            return False
        if last:
            return True
        if every is not None:
            return (r + 1) % every == 0
        now = time.perf_counter()
        if now - self.checkpointed_at < CHECKPOINT_INTERVAL_S:
            return False
        self.checkpointed_at = now
        return True

    def _orders(self, r: int) -> tuple[bool, bool]:
        """Whether round `r` ends with an evaluation, and with a checkpoint. With
        overlap_averaging, decided a round ahead: the workers learn it with the average
        before (`Average.wait_next`)."""
        schedule = self.plan.schedule
        if r >= schedule.num_rounds:
            return False, False
        last = r == schedule.num_rounds - 1
        evaluate = self.plan.data.eval_sizes[0] > 0 and (
            last or schedule.evaluates_after(r, self.plan.config.eval_every))
        return evaluate, self._checkpoints_after(r, last)

    def _round(self, coord: Coordinator, r: int, stop: bool = False) -> None:
        """Round `r`; `stop`: the fit stopped at the round before, so this average ends the
        workers' training and the round is not part of the fit's history."""
        check_saved(self.writer)  # a fit that cannot be resumed stops at once
        config, schedule = self.plan.config, self.plan.schedule
        last = r == schedule.num_rounds - 1
        numel = self.flat.array.size
        if config.overlap_averaging:
            (evaluate, checkpoint), self.orders = self.orders, self._orders(r + 1)
        else:
            evaluate, checkpoint = self._orders(r)
        stats = coord.run_round(
            r, model_numel=numel, allow_state=config.average_optimizer_state,
            evaluate=evaluate, checkpoint=checkpoint, stop=stop,
            wait_next=any(self.orders),
            # the average reaches the driver only if it may keep it (see Stopping)
            need_average=last or self.plan.on_round is not None
            or (evaluate and config.early_stopping is not None),
        )
        done = r + 1  # the round as logged: rounds done (round 0: before training)
        logged = self.history[-1]["round"] if self.history else -1
        if done > logged and not stop:  # a round redone after a restart: logged once
            metrics = round_metrics(stats, self.plan.objective.metrics)
            # the rows the workers not averaged this round did not train on
            metrics["skipped_rows"] = (config.num_workers - stats.workers) * \
                schedule.rows_in_rounds(r, r + 1)
            # strangers the coordinator refused, by reason, so far in this attempt
            metrics.update({f"refused_{k}": v for k, v in coord.refusals().items()})
            self.history.append({"round": done, **metrics})
            self.run_logger.log_metrics(metrics, step=done)
            row = self.history[-1]
            params = coord.average[:numel] if stats.has_average else None
            if (self.stopper.judge(self.history, row, params)
                    or self.stopper.ask(row, params)) and self.stop_round is None:
                self.stop_round = r
            self.progress.update(r, stats.train_loss, metrics.get("eval_accuracy"))
            self.timeline.append({"round": done, "workers": [
                {name: (a - self.t_train, b - self.t_train) for name, (a, b) in w.items()}
                for w in stats.phases]})
        states = self._states(stats.states)
        if states is not None:
            global_state = stats.global_state
            if self.step is not None and self.step.has_state:
                global_state = pack_entries(self.step.state())
            self.point = Checkpoint(
                round=r + 1, steps=schedule.round_start(r + 1),
                params=coord.average[:numel].copy(), states=states,
                fingerprint=self.expected,
                history=[row for row in self.history if row["round"] <= r + 1],
                best=self.stopper.best, stop=self.stopper.state(), global_state=global_state)
            self.writer.submit(self.point)


    def _states(self, states: dict | None) -> list | None:
        """A checkpoint's optimizer states, by rank. In an elastic fit, a worker not present
        keeps its state of the checkpoint before, less its residual, or with none before an
        empty one (`carried_states`)."""
        n = self.plan.config.num_workers
        if states is None or len(states) == n:
            return None if states is None else [states[rank] for rank in range(n)]
        return carried_states(states, self.point.states, n)


def elastic_start(spark, config) -> int | None:
    """How many workers an elastic fit starts with: all, or the task slots the cluster has
    where they are fewer (and at least min_workers); None: not elastic."""
    if config.min_workers is None:
        return None
    from sparkdl_avg.driver import session
    from sparkdl_avg.driver.cluster import training_resources

    slots = session.concurrent_slots(spark, training_resources(spark, config.device)[0])
    return config.num_workers if slots is None else \
        max(config.min_workers, min(config.num_workers, slots))


def round_metrics(stats: RoundStats, metrics=()) -> dict[str, float]:
    """What a round logs; `metrics`: the fit's evaluation metrics (`_metrics`)."""
    eval_s = stats.eval["eval_s"] if stats.eval is not None else 0.0
    communication = max(0.0, stats.round_s - stats.compute_s - stats.averaging_s - eval_s)
    logged = {
        "train_loss": stats.train_loss,
        "samples_per_s": stats.samples / stats.round_s if stats.round_s > 0 else 0.0,
        "time_round_s": stats.round_s,
        "time_compute_s": stats.compute_s,
        "time_communication_s": communication,
        "time_averaging_s": stats.averaging_s,
        "replica_divergence": stats.divergence,
        "driver_mb": stats.driver_bytes / 1e6,
        "wire_mb": stats.wire_bytes / 1e6,
        "workers": stats.workers,
    }
    if stats.outer_norm is not None:
        logged["outer_update_norm"] = stats.outer_norm
    if stats.lr is not None:
        logged["lr"] = stats.lr
    if stats.eval is not None:
        logged.update(eval_metrics(stats.eval, metrics))
    return logged
