"""The driver's side of sync mode: a coordinator and a barrier job per attempt, every round
averaged, every `checkpoint_every` rounds a restart point kept (and saved). When a task
fails, hangs or disconnects, Spark aborts the whole barrier job; the driver then starts a new
one from the last restart point, up to `max_failures` times. The workers take up the data
where that point left off, so with a fixed seed the result is bit-identical to a run without
the failure."""

from __future__ import annotations

import contextlib
import logging
import time
from functools import partial

from sparkdl_avg import _wire
from sparkdl_avg._checkpoint import (
    Checkpoint,
    DirStore,
    MlflowStore,
    check_resumable,
    end_source_run,
    fingerprint,
    target_store,
    writing,
)
from sparkdl_avg._cluster import BarrierJob, Restarts, connect_deadline_s, driver_addresses
from sparkdl_avg._config import TrainConfig
from sparkdl_avg._coordinator import Coordinator, RoundStats
from sparkdl_avg._errors import WorkerLostError
from sparkdl_avg._model import FlatBuffer, averaged_tensors, wire_dtype
from sparkdl_avg._plots import worker_timeline
from sparkdl_avg._progress import Progress
from sparkdl_avg._tracking import RunLogger
from sparkdl_avg._worker import REPORT_SCHEMA, WorkerSpec, run_task

log = logging.getLogger("sparkdl_avg")


def train_sync(spark, plan, config: TrainConfig, classify: bool, run: RunLogger, timings: dict,
               t_start: float,
               resume: tuple[Checkpoint, DirStore | MlflowStore] | None = None
               ) -> tuple[list[dict], list[dict], list[dict]]:
    """Train to the end, restarting after task failures. Returns (history, workers, failures)
    and leaves the final average in `plan.model`."""
    flat = FlatBuffer(averaged_tensors(plan.model), wire_dtype(plan.dtype))
    expected = fingerprint(config, train_rows=plan.data.train_sizes,
                           num_features=plan.data.num_features, model_numel=flat.array.size,
                           dtype=str(plan.dtype))
    source = resume[1] if resume is not None else None
    store = target_store(config, run.run_id, run.tracking_uri, source)
    if resume is not None:
        point = resume[0]
        check_resumable(point, expected, total_steps=plan.schedule.total_steps,
                        source=source.description)
        run.log_params({"resumed_from": source.description, "resumed_at_round": point.round})
        if isinstance(source, MlflowStore):
            end_source_run(run.tracking_uri, source.run_id)
    else:
        point = Checkpoint(round=0, steps=0, params=flat.gather().copy(), states=None,
                           fingerprint=expected)
    history = list(point.history)
    restarts = Restarts(spark, config, run)
    attempt = _Attempt(spark, plan, config, flat, run, history, expected)
    progress = Progress(plan.schedule.num_rounds)
    with contextlib.closing(progress), writing(store) as writer:
        while True:
            try:
                workers = attempt.run(point, classify, progress, writer, timings, t_start)
                break
            except WorkerLostError as exc:
                restarts.record(exc, f"round {attempt.point.round}",
                                step=attempt.point.round)
                point = attempt.point
        timings["train_s"] = time.perf_counter() - attempt.t_train
    if writer.errors:
        run.set_tags({"sparkdl_avg.checkpoint_errors": writer.errors})
    run.log_dict_quietly({"rounds": attempt.timeline}, "worker_timeline.json")
    run.log_figure(lambda: worker_timeline(attempt.timeline, config.num_workers),
                   "plots/worker_timeline.png")
    return history, workers, restarts.failures


class _Attempt:
    """One barrier job: the rounds from a restart point to the end (or to a failure)."""

    def __init__(self, spark, plan, config: TrainConfig, flat: FlatBuffer, run: RunLogger,
                 history: list[dict], expected: dict) -> None:
        self.spark, self.plan, self.config, self.flat = spark, plan, config, flat
        self.run_logger, self.history, self.expected = run, history, expected
        self.point: Checkpoint | None = None
        self.t_train = 0.0
        self.timeline: list[dict] = []
        """Per round: each worker's phases, seconds since training began (for the picture)."""

    def run(self, point: Checkpoint, classify: bool, progress: Progress, writer,
            timings: dict, t_start: float) -> list[dict]:
        plan, config, flat = self.plan, self.config, self.flat
        schedule, has_eval = plan.schedule, plan.data.eval_sizes[0] > 0
        self.point = point
        secret = _wire.new_secret()
        bind, advertise = driver_addresses(self.spark)
        with Coordinator(
            host=bind, advertise=advertise, num_workers=config.num_workers, secret=secret,
            timeout=config.round_timeout, dtype=flat.array.dtype, model_numel=flat.array.size,
            check_job=lambda wait_s: job.check(wait_s),
        ) as coord:
            # Workers connect once their partition is loaded; large data loads slowly.
            connect_s = connect_deadline_s(config.round_timeout)
            spec = WorkerSpec.for_plan(plan, config, classify=classify, secret=secret,
                                       connect_s=connect_s, address=coord.address)
            job = BarrierJob(plan.data.frame, partial(run_task, spec), REPORT_SCHEMA,
                             f"sparkdl-avg: train {config.num_workers} replicas from round "
                             f"{point.round}")
            with job:
                try:
                    coord.accept_workers(point.params, connect_s, start_round=point.round,
                                         states=point.states)
                    timings.setdefault("first_step_s", time.perf_counter() - t_start)
                    self.t_train = self.t_train or time.perf_counter()
                    for r in range(point.round, schedule.num_rounds):
                        self._round(coord, r, has_eval, progress, writer)
                    coord.finish()
                    flat.array[:] = coord.average[:flat.array.size]
                    flat.scatter()
                    rows = job.wait(config.round_timeout)
                except WorkerLostError as exc:
                    coord.close()  # the surviving workers stop waiting for the next average
                    job.explain(exc)
                    raise
        return sorted((row.asDict() for row in rows), key=lambda w: w["partition"])

    def _round(self, coord: Coordinator, r: int, has_eval: bool, progress: Progress,
               writer) -> None:
        config, schedule = self.config, self.plan.schedule
        last = r == schedule.num_rounds - 1
        every = config.checkpoint_every
        stats = coord.run_round(
            r, model_numel=self.flat.array.size, allow_state=config.average_optimizer_state,
            evaluate=has_eval and (last or (r + 1) % config.eval_every == 0),
            checkpoint=every > 0 and (last or (r + 1) % every == 0),
        )
        if r >= len(self.history):  # a round redone after a restart is logged once
            metrics = round_metrics(stats)
            self.history.append({"round": r, **metrics})
            self.run_logger.log_metrics(metrics, step=r)
            progress.update(r, stats.train_loss, metrics.get("eval_accuracy"))
            self.timeline.append({"round": r, "workers": [
                {name: (a - self.t_train, b - self.t_train) for name, (a, b) in w.items()}
                for w in stats.phases]})
        if stats.states is not None:
            self.point = Checkpoint(
                round=r + 1, steps=min((r + 1) * schedule.averaging_frequency,
                                       schedule.total_steps),
                params=coord.average[:self.flat.array.size].copy(), states=stats.states,
                fingerprint=self.expected, history=list(self.history[:r + 1]))
            writer.submit(self.point)


def round_metrics(stats: RoundStats) -> dict[str, float]:
    eval_s = stats.eval["time_s"] if stats.eval is not None else 0.0
    communication = max(0.0, stats.round_s - stats.compute_s - stats.averaging_s - eval_s)
    metrics = {
        "train_loss": stats.train_loss,
        "samples_per_s": stats.samples / stats.round_s if stats.round_s > 0 else 0.0,
        "time_round_s": stats.round_s,
        "time_compute_s": stats.compute_s,
        "time_communication_s": communication,
        "time_averaging_s": stats.averaging_s,
        "replica_divergence": stats.divergence,
    }
    if stats.eval is not None:
        metrics["eval_loss"] = stats.eval["loss"]
        metrics["time_eval_s"] = eval_s
        if "accuracy" in stats.eval:
            metrics["eval_accuracy"] = stats.eval["accuracy"]
    return metrics
