"""The driver's side of async mode: a parameter server beside it (or the user's), the workers'
barrier job, and every `eval_interval_s` the server's parameters evaluated and logged."""

from __future__ import annotations

import contextlib
import logging
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from pyspark.sql import functions as F

from sparkdl_avg import _wire
from sparkdl_avg._cluster import BarrierJob, Restarts, connect_deadline_s, driver_addresses
from sparkdl_avg._data import EVAL, FEATURES, LABEL, SPLIT
from sparkdl_avg._errors import TrainingError, WorkerLostError
from sparkdl_avg._model import FlatBuffer, averaged_tensors, wire_dtype
from sparkdl_avg._ps_client import PSClient
from sparkdl_avg._ps_server import DRIVER
from sparkdl_avg._sidecar import Sidecar
from sparkdl_avg._worker import REPORT_SCHEMA, WorkerSpec, _evaluate, run_task

log = logging.getLogger("sparkdl_avg")


def train_async(spark, plan, config, classify: bool, loss_fn, run, timings: dict,
                t_start: float) -> tuple[list[dict], list[dict], list[dict]]:
    """Returns (history, workers, failures). A failed task makes Spark abort the barrier job;
    the driver relaunches it (up to max_failures) and each worker takes up its data where the
    server's count of its applied steps says. A sidecar that dies is restarted from its
    checkpoint on the same port; the workers reconnect and redo the steps it lost."""
    flat = FlatBuffer(averaged_tensors(plan.model), wire_dtype(plan.dtype))
    bind, advertise = driver_addresses(spark)
    tls_ca_pem = None
    if config.ps_address is not None:
        host, _, port = config.ps_address.rpartition(":")
        secret = bytes.fromhex(Path(config.ps_secret_file).read_text().strip())
        if config.ps_tls_ca:
            tls_ca_pem = Path(config.ps_tls_ca).read_text()
        server = contextlib.nullcontext(None)
        user_address = (host, int(port))
    else:
        secret = _wire.new_secret()
        server = Sidecar(host=bind, secret=secret, settings={
            "algorithm": config.algorithm, "lr": config.lr, "dc_lambda": config.dc_lambda,
            # each push counts 1/n: with staleness_bound=0 this is exactly sync averaging
            "update_scale": 1.0 / config.num_workers,
        }, staleness_bound=config.staleness_bound, timeout=config.round_timeout,
            checkpoint_every=config.checkpoint_every * config.num_workers,
            checkpoint_dir=config.checkpoint_dir)
    eval_data = _collect_eval(plan, classify)
    history: list[dict] = []
    restarts = Restarts(spark, config, run)
    total = plan.schedule.total_steps
    with server as sidecar:
        address = user_address if sidecar is None else (advertise, sidecar.port)

        def connect() -> PSClient:
            return PSClient(address, secret=secret, worker=DRIVER, numel=flat.array.size,
                            dtype=flat.array.dtype, timeout=config.round_timeout,
                            tls_ca_pem=tls_ca_pem)

        server = _Server(sidecar, connect, restarts, run)
        try:
            server.ps.init(flat.gather(), workers=config.num_workers)
            spec = WorkerSpec.for_plan(plan, config, classify=classify, secret=secret,
                                       connect_s=connect_deadline_s(config.round_timeout),
                                       ps_address=address, ps_tls_ca_pem=tls_ca_pem)
            t_train = time.perf_counter()
            timings["first_step_s"] = t_train - t_start  # tasks start training as they load
            previous = {"t": t_train, "applied": 0, "samples": 0, "loss_sum": 0.0}
            while True:
                server.revive(len(history))
                job = BarrierJob(plan.data.frame, partial(run_task, spec), REPORT_SCHEMA,
                                 f"sparkdl-avg: async training, {config.num_workers} workers")
                try:
                    with job:
                        finished = False
                        while not finished:
                            finished = job.done(config.eval_interval_s)
                            metrics = server.call(lambda ps: _interval_metrics(
                                ps, plan.model, flat, eval_data, loss_fn, classify, previous),
                                len(history))
                            # step = rounds' worth of local steps (averaging_frequency
                            # per worker), so sync and async runs line up in MLflow
                            step = int(metrics["updates_applied"]) * config.push_every // (
                                config.num_workers * config.averaging_frequency)
                            history.append({"interval": len(history), "round": step,
                                            **metrics})
                            run.log_metrics(metrics, step=step)
                        rows = job.wait(config.round_timeout)
                except WorkerLostError as exc:
                    job.explain(exc)
                    restarts.record(exc, "each worker's last applied push", step=len(history))
                    continue
                progress = server.call(lambda ps: ps.stats()["progress"], len(history))
                behind = {w: progress.get(str(w), 0) for w in range(config.num_workers)
                          if progress.get(str(w), 0) < total}
                if not behind:
                    break
                # The server restarted from a checkpoint older than some finished workers'
                # last pushes: run the job again; those workers redo only the lost steps.
                restarts.record(WorkerLostError(
                    f"the restarted parameter server lacks the last steps of finished workers "
                    f"(steps applied: {behind} of {total})"), "the steps the server has",
                    step=len(history))
            workers = sorted((row.asDict() for row in rows), key=lambda w: w["partition"])
            timings["train_s"] = time.perf_counter() - t_train
            run.log_dict(server.call(lambda ps: ps.stats(), len(history)), "server_stats.json")
        finally:
            server.close()
    return history, workers, restarts.failures


class _Server:
    """The driver's connection to the parameter server. A sidecar found dead is restarted
    from its checkpoint (on the same port, where the workers reconnect); each restart counts
    against max_failures."""

    def __init__(self, sidecar: Sidecar | None, connect, restarts: Restarts, run) -> None:
        self.sidecar, self._connect, self._restarts, self._run = sidecar, connect, restarts, run
        self.ps = connect()

    def call(self, fn, step: int):
        try:
            return fn(self.ps)
        except (OSError, ConnectionError) as exc:
            if not self.revive(step, grace_s=2.0):
                raise TrainingError(f"lost the parameter server: {exc}") from exc
            return fn(self.ps)

    def revive(self, step: int, grace_s: float = 0.0) -> bool:
        """Restart the sidecar if it died; True if it did."""
        if self.sidecar is None or self.sidecar.alive(grace_s):
            return False
        self.ps.close()
        self._restarts.record(WorkerLostError(
            f"the parameter server process died (exit code {self.sidecar.returncode})"),
            "the server's last checkpoint", step=step)
        self.sidecar.restart()
        self._run.log_metrics({"ps_restarts": self.sidecar.restarts}, step=step)
        self.ps = self._connect()
        return True

    def close(self) -> None:
        self.ps.close()


def _collect_eval(plan, classify: bool):
    if plan.data.eval_sizes[0] == 0:
        return None
    table = plan.data.frame.filter(F.col(SPLIT) == EVAL).select(FEATURES, LABEL).toArrow()
    x = table.column(FEATURES).combine_chunks().flatten().to_numpy(zero_copy_only=False)
    x = torch.from_numpy(x.reshape(len(table), plan.data.num_features).copy()).to(plan.dtype)
    y = table.column(LABEL).to_numpy(zero_copy_only=False)
    y = torch.from_numpy(y.copy())
    return x, (y.long() if plan.long_labels else y.to(plan.dtype))


def _interval_metrics(ps: PSClient, model, flat: FlatBuffer, eval_data, loss_fn,
                      classify: bool, previous: dict) -> dict[str, float]:
    """Pull the server's parameters into the driver's model, evaluate, diff the counters."""
    ps.pull()
    np.copyto(flat.array, ps.params)
    flat.scatter()
    stats = ps.stats()
    now = time.perf_counter()
    elapsed = max(now - previous["t"], 1e-9)
    metrics = {
        "updates_applied": stats["applied"],
        "updates_per_s": (stats["applied"] - previous["applied"]) / elapsed,
    }
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
    if eval_data is not None:
        result = _evaluate(model, *eval_data, loss_fn, classify)
        metrics["eval_loss"] = result["loss_sum"] / max(1, result["count"])
        if result["correct"] is not None:
            metrics["eval_accuracy"] = result["correct"] / max(1, result["count"])
    previous.update(t=now, applied=stats["applied"], samples=stats["samples"],
                    loss_sum=stats["loss_sum"])
    return metrics
