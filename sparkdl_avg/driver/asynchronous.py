"""Async mode on the driver: a parameter server beside it (or the user's), the workers'
training job, and every `eval_interval_s` the server's counters logged and, with eval_df, an
evaluation of the server's parameters requested. The workers evaluate it on their own
evaluation partitions (the training job holds a slot a worker, and the evaluation data never comes
to the driver); the server adds their sums up, and the driver logs the result. The final
parameters are evaluated by the workers before their tasks end.

The training tasks run as a normal Spark stage: Spark runs a failed task again alone
(`spark.task.maxFailures`) while the others train on, and the new attempt takes up its data
where the server's count of its applied steps says (`task_retries` records it); the server
serves a worker id's latest attempt only. A task out of tries fails the job; the restart loop
then relaunches it, each worker again taking up where the server says. A sidecar that dies is
restarted from its checkpoint on the same port; the workers reconnect and redo the steps it
lost."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path

import numpy as np

from sparkdl_avg._errors import (
    ConfigError,
    PeerRefused,
    TrainingError,
    WorkerLostError,
)
from sparkdl_avg.averaging.flat_buffer import (
    FlatBuffer,
    averaged_tensors,
    trainable_parameters,
    wire_dtype,
)
from sparkdl_avg.driver.barrier import BarrierJob
from sparkdl_avg.driver.cluster import driver_address
from sparkdl_avg.driver.early_stop import Stopping
from sparkdl_avg.driver.plan import FitPlan, TrainOutcome
from sparkdl_avg.driver.restarts import Restarts
from sparkdl_avg.driver.server_connection import ServerConnection
from sparkdl_avg.driver.task_retries import TaskRetries
from sparkdl_avg.net.auth import new_secret
from sparkdl_avg.net.tls import read_certificates
from sparkdl_avg.ps.client import PSClient
from sparkdl_avg.ps.server import DRIVER
from sparkdl_avg.ps.settings import COMPARED, ServerSettings
from sparkdl_avg.ps.sharded_client import ShardedClient
from sparkdl_avg.ps.sharded_client import connect as connect_ps
from sparkdl_avg.ps.shards import parse_addresses, shard_name
from sparkdl_avg.ps.sidecar import Sidecar
from sparkdl_avg.ps.staleness import pushes_between_fetches
from sparkdl_avg.task.evaluate import eval_metrics
from sparkdl_avg.tracking.run import RunLogger

log = logging.getLogger("sparkdl_avg")


def server_settings(config) -> ServerSettings:
    """The settings of a fit's own parameter server."""
    num_workers = config.num_workers
    return ServerSettings(
        algorithm=config.algorithm, lr=config.lr, dc_lambda=config.dc_lambda,
        # each push counts 1/n: with staleness_bound=0 this is exactly sync averaging
        update_scale=1.0 / num_workers, staleness_bound=config.staleness_bound,
        timeout=config.waits().round,
        # every worker, a replacement for each while a stale connection lingers, the driver
        max_connections=2 * num_workers + 2,
        checkpoint_every=config.ps_checkpoint_every * num_workers)


def _say_how_often_workers_fetch(config) -> None:
    """fetch_every beyond what the staleness bound allows is shortened (in each task): say so
    once, here, where the user reads it."""
    pushes = pushes_between_fetches(config.push_every, config.fetch_every,
                                    config.staleness_bound)
    if config.fetch_every and pushes * config.push_every < config.fetch_every:
        log.warning("fetch_every=%d with staleness_bound=%d: each worker fetches every %d "
                    "steps instead (%d pushes): a push waits until every other worker has "
                    "read within %d pushes, so fetching more rarely would stall the fit",
                    config.fetch_every, config.staleness_bound, pushes * config.push_every,
                    pushes, config.staleness_bound)


def train_async(spark, plan: FitPlan, run: RunLogger) -> TrainOutcome:
    config = plan.config
    _say_how_often_workers_fetch(config)
    flat = FlatBuffer(averaged_tensors(plan.model), wire_dtype(plan.dtype))
    waits = config.waits()
    tls_ca_pem = None
    history: list[dict] = []
    restarts = Restarts(spark, config, run)
    retries = TaskRetries()
    with contextlib.ExitStack() as stack:
        if config.ps_address is not None:
            addresses = parse_addresses(config.ps_address)
            secret = bytes.fromhex(Path(config.ps_secret_file).read_text().strip())
            if config.ps_tls_ca:
                tls_ca_pem = read_certificates(config.ps_tls_ca, "ps_tls_ca")
            sidecars: list[Sidecar] = []
        else:
            secret = new_secret()
            listen = driver_address(spark, config)
            sidecars = [stack.enter_context(Sidecar(
                server_settings(config), host=listen.bind, secret=secret,
                port=listen.port + k if listen.port else 0,
                checkpoint_dir=config.checkpoint_dir, name=shard_name(k, config.ps_shards)))
                for k in range(config.ps_shards)]
            addresses = [(listen.advertise, sidecar.port) for sidecar in sidecars]

        def connect() -> PSClient | ShardedClient:
            return connect_ps(addresses, secret=secret, worker=DRIVER,
                              numel=flat.array.size, dtype=flat.array.dtype,
                              timeout=waits.round, tls_ca_pem=tls_ca_pem)

        server = ServerConnection(sidecars, connect, restarts, run,
                                   reconnect_s=waits.reconnect)
        try:
            _init(server, flat, config, run,
                  gradients=sum(p.numel() for p in trainable_parameters(plan.model)))
            spec = plan.worker_spec(addresses[0], tls_ca_pem)
            if len(addresses) > 1:
                spec = dataclasses.replace(spec, ps_shards=tuple(addresses))
            t_train = time.perf_counter()  # tasks start training as they load
            intervals = _Intervals(plan, flat, run, history)
            server.call(intervals.ask_first, 0)

            def attempt() -> list[dict]:
                server.revive(len(history))
                with BarrierJob.training(plan.data.frame, spec, "sparkdl-avg: async "
                                         f"training, {config.num_workers} workers",
                                         config, run, secret=secret,
                                         evict=retries.back) as job:
                    retries.job = job
                    while not job.done(config.eval_interval_s):
                        server.call(intervals.log, len(history))
                    rows = job.wait(waits.finish)
                stats = server.call(lambda ps: ps.stats(), len(history))
                if not stats["stopped"]:  # early stopping ends workers before their last step
                    _check_complete(stats["progress"], config.num_workers,
                                    plan.schedule.total_steps)
                server.call(intervals.log_final, len(history))
                return rows

            rows = restarts.run(
                attempt, resume_at=lambda exc: exc.resume_at or "each worker's last applied push",
                step=lambda: len(history))
            workers = sorted((row.asDict() for row in rows), key=lambda w: w["partition"])
            train_s = time.perf_counter() - t_train
            run.log_dict(server.call(lambda ps: ps.stats(), len(history)), "server_stats.json")
            intervals.stopper.record(run, history)
        finally:
            server.close()
    return TrainOutcome(history=history, workers=workers,
                        failures=restarts.failures + retries.records,
                        first_step_at=t_train, train_s=train_s)


def _init(server: ServerConnection, flat: FlatBuffer, config, run: RunLogger, *,
          gradients: int) -> None:
    """Start the server from the initial parameters, the first `gradients` of them trained
    by gradients (the rest statistics: `ps.rules`). A server of the user's whose algorithm,
    lr or staleness bound differ from the fit's refuses, and the fit stops before any task."""
    expect = {key: getattr(config, key) for key in COMPARED}
    try:
        settings = server.ps.init(flat.gather(), workers=config.num_workers, expect=expect,
                                  gradients=gradients)
    except PeerRefused as exc:
        if exc.reason == "settings":
            raise ConfigError(f"{exc}; set the fit's TrainConfig to match, or start the "
                              f"server ({config.ps_address}) with the fit's values") from None
        raise
    # tags, not params: runs of both modes keep one set of param keys to compare by
    run.set_tags({f"sparkdl_avg.ps.{key}": value for key, value in settings.items()})


def check_server_saved(report: dict) -> None:
    """A TrainingError once the server could not save its checkpoint: a server that crashed
    could then not be restarted where it was, so the fit stops rather than end FINISHED
    without one. Checked with each interval's report and after the job; a save failing after
    the final report fails nothing, as no restart can follow it (async fits do not resume)."""
    failed = report.get("checkpoint_error")
    if failed:
        raise TrainingError(f"{failed}: a parameter server that crashed could not be "
                            "restarted from it; free space or fix where it writes (the fit's "
                            "checkpoint_dir, or the --checkpoint-file of the server at "
                            "ps_address), then fit again")


def _check_complete(progress: dict, num_workers: int, total: int) -> None:
    """After the job: a server restarted from a checkpoint older than some finished workers'
    last pushes lacks their last steps. Run the job again; those workers redo only those."""
    behind = {w: progress.get(str(w), 0) for w in range(num_workers)
              if progress.get(str(w), 0) < total}
    if behind:
        exc = WorkerLostError(f"the restarted parameter server lacks the last steps of "
                              f"finished workers (steps applied: {behind} of {total})")
        exc.resume_at = "the steps the server has"
        raise exc


class _Intervals:
    """Every `eval_interval_s`: the server's counters as rates since the last interval,
    logged to MLflow. With eval_df, the same call asks the workers to evaluate the server's
    parameters of that moment (one request at a time); a result is logged at the step of the
    interval that asked for it, and the final one with the last interval."""

    def __init__(self, plan: FitPlan, flat: FlatBuffer, run: RunLogger,
                 history: list[dict]) -> None:
        self.plan, self.flat, self.run, self.history = plan, flat, run, history
        self.evaluates = plan.data.eval_sizes[0] > 0
        self.asked: tuple[int, dict] | None = None
        """The request in flight, and the history row it is of."""
        self.stopper = Stopping(plan.config.early_stopping, plan.on_round)
        self.asked_params: np.ndarray | None = None
        """Early stopping: a copy of the parameters the request in flight evaluates."""
        self.previous = {"t": time.perf_counter(), "applied": 0, "samples": 0, "loss_sum": 0.0}

    def ask_first(self, ps: PSClient) -> None:
        """Round 0: before the workers start, a request of the initial parameters, which
        each worker answers before its first step (`task.async_loop`); logged at step 0."""
        if not self.plan.config.evaluates_first(self.evaluates):
            return
        pending = ps.evaluate()["evaluations"]["pending"]
        if pending is not None and pending["applied"] == 0:
            row = {"round": 0}
            self.history.append(row)
            self.asked = (pending["request"], row)
            self.asked_params = self.flat.gather().copy() if self.stopper.rule else None

    def log(self, ps: PSClient) -> None:
        ask = self.evaluates and self.asked is None
        report = ps.evaluate() if ask else ps.stats()
        check_server_saved(report)
        row = self._row(report)
        pending = report["evaluations"]["pending"]
        # early stopping keeps the snapshot itself (the server moves on); a request replaced
        # before it could be fetched is not followed: the next interval asks anew
        if ask and pending is not None and not pending["final"] \
                and pending["applied"] == report["applied"] \
                and (self.stopper.rule is None or ps.pull_snapshot() == pending["request"]):
            self.asked = (pending["request"], row)
            self.asked_params = ps.params.copy() if self.stopper.rule else None
        if self.stopper.stopped_by is not None and not report.get("stopped"):
            self._stop(ps)  # a server restarted from a checkpoint older than the stop
        self._collect(report["evaluations"], ps)
        if not self.evaluates and self.stopper.ask(row, None):  # else: with its evaluation
            self._stop(ps)

    def log_final(self, ps: PSClient) -> None:
        """After the job: the final parameters into the driver's model, the last interval,
        and the workers' evaluation of those parameters."""
        ps.pull()
        np.copyto(self.flat.array, ps.params)
        report = ps.stats()
        check_server_saved(report)
        row = self._row(report)
        self._collect(report["evaluations"], ps)
        # the server asks nothing after its final request: that result stays its newest
        final = [r for r in report["evaluations"]["results"]
                 if r["final"] and r["applied"] == report["applied"]]
        if final:
            self._log_eval(row, final[-1])
            self.stopper.judge(self.history, row, ps.params.copy())  # the best may be last
        elif self.evaluates:
            log.warning("the workers' evaluation of the final parameters did not complete "
                        "(a worker gave up waiting reply_timeout for its peers, or the "
                        "server restarted after it); the last eval metrics are of earlier "
                        "parameters")
        chosen = self.stopper.result()  # early stopping: the best, or where it stopped
        if chosen is not None:
            np.copyto(self.flat.array, chosen)
        self.flat.scatter()

    def _collect(self, evaluations: dict, ps: PSClient) -> None:
        """The result of the request in flight, logged once complete. A request in flight
        that is neither pending nor complete was replaced by the final one or lost with a
        restarted server: the next call asks anew."""
        for result in evaluations["results"]:
            if self.asked is not None and not result["final"] \
                    and result["request"] == self.asked[0]:
                self._log_eval(self.asked[1], result)
                row = self.asked[1]
                if self.stopper.judge(self.history, row, self.asked_params) or \
                        self.stopper.ask(row, self.asked_params):
                    self._stop(ps)
                self.asked = None
        pending = evaluations["pending"]
        if self.asked is not None and (pending is None or pending["final"]
                                       or pending["request"] != self.asked[0]):
            if self.asked[1]["round"] == 0:  # round 0, lost with a restarted server
                log.warning("the evaluation before training was lost with a restarted "
                            "parameter server: the fit has no round 0")
                self.history.remove(self.asked[1])
            self.asked = None

    def _stop(self, ps: PSClient) -> None:
        """The workers push no more; the job ends as after their last steps. Said again to
        a server restarted from a checkpoint taken before it heard."""
        ps.stop()

    def _log_eval(self, row: dict, result: dict) -> None:
        metrics = eval_metrics(result, self.plan.objective.metrics)
        row.update(metrics)
        self.run.log_metrics(metrics, step=row["round"])

    def _row(self, stats: dict) -> dict:
        """The interval's history row, logged; `stats`: the server's counters."""
        metrics = self._metrics(stats)
        # one "round" = push_every local steps of every worker: a sync run averaging every
        # push_every steps lines up with this one in MLflow
        step = int(metrics["updates_applied"]) // self.plan.config.num_workers
        interval = sum("interval" in row for row in self.history)  # round 0 is none
        row = {"interval": interval, "round": step, **metrics}
        self.history.append(row)
        self.run.log_metrics(metrics, step=step)
        return row

    def _metrics(self, stats: dict) -> dict[str, float]:
        previous, now = self.previous, time.perf_counter()
        elapsed = max(now - previous["t"], 1e-9)
        metrics = {"updates_applied": stats["applied"],
                   "updates_per_s": (stats["applied"] - previous["applied"]) / elapsed}
        if stats.get("lr") is not None:
            metrics["lr"] = stats["lr"]
        samples = stats["samples"] - previous["samples"]
        if samples > 0:
            metrics["train_loss"] = (stats["loss_sum"] - previous["loss_sum"]) / samples
            metrics["samples_per_s"] = samples / elapsed
        all_staleness = [s for s in stats["staleness"].values() if s["count"]]
        if all_staleness:
            metrics["staleness_mean"] = float(np.average(
                [s["mean"] for s in all_staleness], weights=[s["count"] for s in all_staleness]))
            metrics["staleness_max"] = max(s["max"] for s in all_staleness)
        for worker, s in stats["staleness"].items():
            metrics[f"staleness_mean_worker_{worker}"] = s["mean"]
        for reason, count in stats["refused"].items():
            metrics[f"refused_{reason}"] = count
        self.previous = {"t": now, "applied": stats["applied"], "samples": stats["samples"],
                         "loss_sum": stats["loss_sum"]}
        return metrics
